"""Which point-to-point messages a pipeline action sends and receives, derived from the schedule.

There is no lowered schedule with SEND/RECV actions: the transfers of an action follow from the
placement (and its routes) alone, so both interpreters (``loom.pipeline.runtime`` and SkipPipe's
``loom.pipeline.paths_runtime``) derive them here, the same way for every family. A
``Transfer`` names the message into ``stage`` for ``microbatch`` in one direction (0: the
activation, 1: its gradient) and its tag, ``(stage·M + microbatch)·2 + direction``, unique
within a step, so matching by (source, tag) cannot pair the wrong messages whatever order the
ranks post them in. Vocabulary parallelism's messages use the tags of virtual stages past the
last (``vocab_transfer``). ``forward_only`` is the F-only schedule evaluation runs. Nothing here
communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.schedule.ir import Action, Op, Schedule

ACTIVATION, GRADIENT = 0, 1
WIRE_DTYPE = torch.float32  # activations and their gradients travel in fp32 (see step())


@dataclass(frozen=True)
class Transfer:
    """A point-to-point message: into ``stage`` for ``microbatch``, ``direction`` 0 or 1."""

    stage: int
    microbatch: int
    direction: int
    peer: int  # rank of the other side (pipeline rank here; global in paths_runtime)

    def tag(self, num_microbatches: int) -> int:
        return (self.stage * num_microbatches + self.microbatch) * 2 + self.direction


def incoming(schedule: Schedule, rank: int, action: Action) -> Transfer | None:
    """The receive ``action`` (on ``rank``) needs from another rank, if any."""
    s, mb = action.stage, action.microbatch
    if action.op is Op.F and not schedule.is_first(s) and schedule.rank_of(s - 1) != rank:
        return Transfer(s, mb, ACTIVATION, schedule.rank_of(s - 1))
    if action.op in (Op.I, Op.B) and not schedule.is_last(s) \
            and schedule.rank_of(s + 1) != rank:
        return Transfer(s, mb, GRADIENT, schedule.rank_of(s + 1))
    return None


def outgoing(schedule: Schedule, action: Action) -> Transfer | None:
    """Where the result of ``action`` goes: a transfer into the neighbouring stage (its ``peer``
    is the sender's own rank when the neighbour is local), or None at the ends of the
    microbatch's route and for W."""
    s, mb = action.stage, action.microbatch
    if action.op is Op.F and not schedule.is_last(s):
        return Transfer(s + 1, mb, ACTIVATION, schedule.rank_of(s + 1))
    if action.op in (Op.I, Op.B) and not schedule.is_first(s):
        return Transfer(s - 1, mb, GRADIENT, schedule.rank_of(s - 1))
    return None


# Vocabulary parallelism's messages (module docstring): their tags are those of virtual stages
# num_stages + kind, so they never meet a stage boundary's.
X_OUT, STATS, DX_PART, EMBED_PART, EMBED_GRAD = range(5)


def vocab_transfer(schedule: Schedule, kind: int, microbatch: int, peer: int) -> Transfer:
    """The message of vocabulary-parallel ``kind`` for ``microbatch`` from or to ``peer``."""
    return Transfer(schedule.num_stages + kind, microbatch, ACTIVATION, peer)


def vocab_incoming(schedule: Schedule, rank: int, action: Action) -> list[Transfer]:
    """The receives a vocabulary-parallel ``action`` needs on ``rank``: S the last stage's output,
    T every other shard's statistics, the last stage's I or B every other shard's part of dX."""
    last_rank = schedule.rank_of(schedule.num_stages - 1)
    others = [q for q in range(schedule.pp_size) if q != rank]
    mb = action.microbatch
    if action.op is Op.S:
        return [] if last_rank == rank else [vocab_transfer(schedule, X_OUT, mb, last_rank)]
    if action.op is Op.T:
        return [vocab_transfer(schedule, STATS, mb, q) for q in others]
    if action.op in (Op.I, Op.B) and action.stage == schedule.num_stages - 1 \
            and schedule.has_vocab_passes:
        return [vocab_transfer(schedule, DX_PART, mb, q) for q in others]
    return []


def forward_only(schedule: Schedule) -> Schedule:
    """An F-only schedule with ``schedule``'s placement and routes: each rank runs its stages in
    increasing order, every microbatch that visits a stage before the next (deadlock-free: data
    flows to higher stages only). Used for evaluation. With vocabulary passes every rank then
    runs S of every microbatch, then T (the loss, no backward)."""
    rows = []
    for rank in range(schedule.pp_size):
        vocab = ([Action(rank, op, mb) for op in (Op.S, Op.T)
                  for mb in range(schedule.num_microbatches)]
                 if schedule.has_vocab_passes else [])
        rows.append(tuple(Action(stage, Op.F, mb) for stage in schedule.stages_of(rank)
                          for mb in range(schedule.num_microbatches)
                          if stage in schedule.route_stages(mb)) + tuple(vocab))
    return Schedule(schedule.num_stages, schedule.num_microbatches, schedule.placement,
                    tuple(rows), name=f"{schedule.name}-forward",
                    num_routes=schedule.num_routes, routes=schedule.routes)


__all__ = ["ACTIVATION", "GRADIENT", "WIRE_DTYPE", "Transfer", "forward_only", "incoming",
           "outgoing", "vocab_incoming", "vocab_transfer"]
