"""The copy sum of schedules with routes (``bidirectional_v``: two copies of the model): every
model stage's gradient summed with its other copy over the ranks holding the copies
(``runtime.copy_groups``: rank r and its mirror p-1-r), eagerly where it can be.

What is summed. A stage's gradients as the optimizer will step them: the parameters' gradients
(fp32 ``main_grad`` of bf16 parameters; a DTensor's local tensor), or under ZeRO-1/2 the reduced
flat slices the sharded optimizer steps (``bucket.shard.grad``). Mirror ranks share their dp
(and tp, cp, ep) coordinates and build the same buckets from the same model stage, so the
slices line up element by element; the ZeRO-1 parameters' own ``.grad`` views hold this rank's
unreduced gradients, which nothing steps, and are not summed.

Units. One unit per model stage, except a tied model's two ends, which share one Parameter on
their rank (each copy's ends sit on one rank): one unit, ready when both ends are. Every unit is
one all-reduce over the pair, ``4·P_unit`` bytes (axis ``pp_copies``), so a step moves the same
bytes as one flat sum of the rank's stages, in one call per unit.

Eager synchronisation (BitPipe's). Both ranks of a pair issue the units' all-reduces in one
order (they must: collectives on a group are matched by order), derived from the schedule alone:
by the later of the two ranks' positions of the unit's last weight-gradient piece (W or B), then
model stage. Without a data-parallel reducer a rank starts a unit's all-reduce (``async_op``) as
soon as its own last piece of that unit and of every unit before it is done, so the sum moves
while the rest of the schedule computes. The overlap comes from the drain: a rank's four stages
finish their last W at different points of its order (the stage whose last microbatch left it
first finishes first), so all but the last unit can move while the remaining W pieces run.
Loom's greedy order fills the drain with W pieces, so that is the last few percent of the step
(simulated shares in docs/design.md, "BitPipe in full"). All handles are waited for in
``finish``, before clipping and the optimizer step. With a data-parallel reducer
(dp, ZeRO-1/2/3) the sum must follow the dp average for the same bits (the end-of-step order),
so the units are launched after the reducers finish, back to back. Either way each element is
the sum of the same two values (a + b = b + a exactly), so eager and end-of-step sums are
bit-identical. Only gloo has run the eager path: on NCCL the pair's all-reduces interleave with
the pp group's sends and receives in a rank-dependent order (docs/design.md, "BitPipe in full").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.compression import copy_back
from loom.parallel.mixed_precision import gradient_of
from loom.parallel.zero import ZeroShardedOptimizer
from loom.pipeline.stage import PipelineStage
from loom.schedule.ir import Op, Schedule


@dataclass(frozen=True)
class CopyUnit:
    """Model stages summed in one all-reduce, this rank's schedule stages holding them, and the
    index in this rank's action list of their last weight-gradient piece (-1: none)."""

    model_stages: tuple[int, ...]
    stages: tuple[int, ...]
    last_piece: int


def _last_pieces(schedule: Schedule, rank: int) -> dict[int, int]:
    """Schedule stage -> index of its last W or B in ``rank``'s action list."""
    last: dict[int, int] = {}
    for index, action in enumerate(schedule.actions[rank]):
        if action.op in (Op.W, Op.B):
            last[action.stage] = index
    return last


def copy_units(schedule: Schedule, rank: int, pair: tuple[int, ...],
               tied: bool) -> list[CopyUnit]:
    """``rank``'s copy-sum units, in the order every rank of ``pair`` (the ranks holding copies
    of its model stages) issues them; ``tied``: the model ties its embedding and head, whose
    ends then share one Parameter on each copy's rank (one unit)."""
    length = schedule.stages_per_route
    groups = [(j,) for j in sorted(s % length for s in schedule.stages_of(rank))]
    ends_together = all(schedule.rank_of(k * length) == schedule.rank_of(k * length + length - 1)
                        for k in range(schedule.num_routes))
    if tied and length > 1 and ends_together and (0,) in groups:
        groups = [(0, length - 1)] + [g for g in groups if g not in ((0,), (length - 1,))]
    last = {member: _last_pieces(schedule, member) for member in pair}

    def stages_on(member: int, model_stages: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(s for s in schedule.stages_of(member) if s % length in model_stages)

    def position(member: int, model_stages: tuple[int, ...]) -> int:
        return max((last[member].get(s, -1) for s in stages_on(member, model_stages)),
                   default=-1)

    units = [CopyUnit(g, stages_on(rank, g), position(rank, g)) for g in groups]
    return sorted(units, key=lambda u: (max(position(m, u.model_stages) for m in pair),
                                        u.model_stages))


class RouteCopySum:
    """Sums this rank's stages' gradients with their copies over ``group`` (one unit at a time,
    ``copy_units``' order); ``eager`` starts a unit's sum right after its last piece when the
    stages have no data-parallel reducer (see the module docstring)."""

    def __init__(self, units: list[CopyUnit], stages: dict[int, PipelineStage],
                 reducers: dict, group: dist.ProcessGroup,
                 ledger: CommLedger | None = None, eager: bool = True) -> None:
        self.units, self.stages, self.reducers = units, stages, reducers
        self.group, self.ledger, self.eager = group, ledger, eager
        self._next = 0
        self._pending: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        self.launched_early = 0  # the last step's units started during the schedule (eager)
        # where the sums run: the stages' device (ZeRO's offloaded slices live on the host)
        self.device = next(p for stage in stages.values() for p in stage.parameters()).device

    @property
    def waits_for_reducers(self) -> bool:
        """The stages' gradients are final only after their data-parallel reduction."""
        return any(s in self.reducers for unit in self.units for s in unit.stages)

    def begin_step(self) -> None:
        self._next = 0

    def after_action(self, index: int) -> None:
        """The action at ``index`` of this rank's list is done: launch the units it completes."""
        if not self.eager or self.waits_for_reducers:
            return
        while self._next < len(self.units) and self.units[self._next].last_piece <= index:
            self._launch(self.units[self._next])
            self._next += 1

    def finish(self) -> None:
        """Launch the units not launched yet, wait for every sum and write it back (call after
        the data-parallel reducers' ``finish``)."""
        self.launched_early = self._next
        if self.eager or self._next:
            for unit in self.units[self._next:]:
                self._launch(unit)
        else:  # the end-of-step sum: one flat all-reduce of every unit, as before eager sync
            tensors = [t for unit in self.units for t in self._tensors(unit)]
            self._start(tensors)
        self._next = len(self.units)
        pending, self._pending = self._pending, []
        for work, flat, tensors in pending:
            work.wait()
            copy_back(flat, tensors)

    def _launch(self, unit: CopyUnit) -> None:
        self._start(self._tensors(unit))

    def _start(self, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1).to(self.device) for t in tensors])
        work = comm.all_reduce(flat, self.group, axis="pp_copies", ledger=self.ledger,
                               async_op=True)
        self._pending.append((work, flat, tensors))

    def _tensors(self, unit: CopyUnit) -> list[torch.Tensor]:
        """What is summed for ``unit``, in model-stage order (the same on both ranks)."""
        ordered = sorted(unit.stages, key=lambda s: self.stages[s].model_stage)
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for index in ordered:
            reducer = self.reducers.get(index)
            if isinstance(reducer, ZeroShardedOptimizer):  # the reduced slices it steps
                tensors += [bucket.shard.grad for bucket in reducer.buckets]
                continue
            for param in self.stages[index].parameters():
                if id(param) in seen:  # a tied head is the embedding: summed once
                    continue
                seen.add(id(param))
                grad = gradient_of(param, create=True)  # zeros: keeps the pair matched
                tensors.append(getattr(grad, "_local_tensor", grad))
        return tensors
