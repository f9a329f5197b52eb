"""The pipeline schedule IR: actions, placements, schedules and their file formats.

A schedule is plain data: for every pipeline rank, the ordered list of compute actions it runs.
An action is ``Action(stage, op, microbatch)`` and prints in PyTorch's one-token form (``2F0``,
``1I3``, ``0W2``, ``3B1``), so schedules can be exchanged with ``torch.distributed.pipelining``
through its CSV format (one row per rank, one action per cell). Idle steps are not part of the
IR: a rank simply waits for the dependencies of its next action (see ``loom.schedule.validate``).

Routes (replicated stages). By default every microbatch visits every stage, 0 to n-1. A schedule
may instead hold ``num_routes`` copies of an L-stage model: stage ``r * L + j`` is copy ``r`` of
stage j, and microbatch m visits only the stages of its route ``routes[m]``, in order. This is
what bidirectional schedules (BitPipe, Chimera, DualPipe) need: two copies of the model placed in
opposite directions, half the microbatches through each; the copies' weight gradients must be
summed before the optimizer step. PyTorch's CSV cannot say which route a microbatch takes (its
rows are ranks, its cells actions), so Loom writes such schedules with one extra final row, the
routes row ``routes=<num_routes>,<route of microbatch 0>,<of 1>,...``: Loom's extension, which
``from_torch_csv`` reads back and torch's own reader refuses (the first cell is no action); a
one-route schedule's CSV is torch's format unchanged.

Vocabulary parallelism across the pipeline (Yeung et al. 2024, ``loom.schedule.vocab_passes``):
the output layer and its loss are split over the vocabulary onto every pipeline rank, and run as
two passes per microbatch on every rank, ``S`` (this shard's logits and their softmax statistics)
and ``T`` (the loss from every shard's statistics, this shard's weight gradient and its part of
the gradient of the last stage's output). For these two ops the number before the letter is the
vocabulary shard, which is the pipeline rank holding it (``2S5``: shard 2's S of microbatch 5 on
rank 2), not a stage. Torch's CSV has no such tokens: such schedules travel as JSON.

Everything that runs, simulates or plans a pipeline consumes this one type. Nothing here imports
torch.
"""

from __future__ import annotations

import csv
import enum
import io
import itertools
import json
import operator
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from fractions import Fraction
from typing import IO

from loom.errors import loads_json, read_input_text


class Op(str, enum.Enum):
    """A compute operation on one (stage, microbatch).

    ``B`` is the full backward; zero-bubble schedules split it into ``I`` (gradient w.r.t. the
    stage input, on the critical path) and ``W`` (gradient w.r.t. the weights, deferrable).
    """

    F = "F"
    I = "I"  # noqa: E741  (the letter is the established name: torch and the ZB paper use it)
    W = "W"
    B = "B"
    # PipeOffload (Wan et al. 2025): not compute but host transfers, run on a copy stream beside
    # it. ``O`` moves the saved activations of (stage, microbatch) to host memory after its F,
    # ``R`` brings them back before its backward (``loom.schedule.offload`` places, checks and
    # prices them). Torch's CSV has no such tokens: schedules holding them travel as JSON.
    O = "O"  # noqa: E741
    R = "R"
    # Vocabulary parallelism (``loom.schedule.vocab_passes``): the output layer's passes on one
    # vocabulary shard; the action's number is the shard (= its pipeline rank), not a stage.
    S = "S"
    T = "T"

    @property
    def is_transfer(self) -> bool:
        """An offload or reload (a host transfer), not a compute step."""
        return self is Op.O or self is Op.R

    @property
    def is_vocab(self) -> bool:
        """An output-layer pass on a vocabulary shard (S or T), not a stage's compute."""
        return self is Op.S or self is Op.T


# The largest pipeline step Loom builds: ranks x microbatches x stages per rank. A step is
# 2-3 actions per (stage, microbatch), made, validated and simulated in Python: past this it
# takes minutes and gigabytes (p = 64 with 10^5 microbatches of 1F1B: 289 s and 12 GB to check
# a config), while the largest published pipelines are p <= 128 with m <= 4096 (a stage a rank)
MAX_STEP_CELLS = 2**20

_ACTION_PATTERN = re.compile(r"^(\d+)([FIWBORST])(\d+)$")


@dataclass(frozen=True, order=True, init=False)
class Action:
    """One compute step: run ``op`` of ``stage`` on ``microbatch``. ``str()`` gives ``2F0``."""

    stage: int
    op: Op
    microbatch: int

    def __init__(self, stage: int, op: Op, microbatch: int) -> None:
        # What the frozen dataclass's own __init__ does (three ``object.__setattr__``), written
        # straight into the instance dict: the same object, built in under half the time (the
        # families build ~10^5 of them per schedule at p = 32, m = 256).
        fields = self.__dict__
        fields["stage"] = stage
        fields["op"] = op
        fields["microbatch"] = microbatch

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse PyTorch's action token, e.g. ``Action.parse("2F0")``."""
        match = _ACTION_PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><F|I|W|B><microbatch>, e.g. '2F0'"
                " (or the ops O, R of PipeOffload, S, T of vocabulary parallelism)"
            )
        stage, op, microbatch = match.groups()
        return cls(int(stage), Op(op), int(microbatch))


_OP_OF = operator.attrgetter("op")  # an Action's op, read at C level


# ----------------------------------------------------------------------------------------------
# Placements: stage -> pipeline rank, as a tuple indexed by stage.


def looped_placement(pp_size: int, chunks: int = 1) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % pp_size`` (GPipe, 1F1B, interleaved 1F1B, looped BFS)."""
    _check_positive(pp_size=pp_size, chunks=chunks)
    return tuple(stage % pp_size for stage in range(pp_size * chunks))


def v_placement(pp_size: int, chunks: int = 2) -> tuple[int, ...]:
    """Zig-zag placement: chunk 0 runs down ranks 0..p-1, chunk 1 back up p-1..0, and so on.

    With ``chunks=2`` this is the V shape of ZB-V / DualPipeV (the last stage sits on rank 0);
    with more chunks it is the wave placement of Hanayo.
    """
    _check_positive(pp_size=pp_size, chunks=chunks)
    placement = []
    for chunk in range(chunks):
        ranks = range(pp_size) if chunk % 2 == 0 else range(pp_size - 1, -1, -1)
        placement.extend(ranks)
    return tuple(placement)


def explicit_placement(stage_to_rank: Mapping[int, int] | Sequence[int]) -> tuple[int, ...]:
    """A placement from an explicit map; stages must be exactly ``0..n-1`` and ranks ``0..p-1``."""
    if isinstance(stage_to_rank, Mapping):
        if sorted(stage_to_rank) != list(range(len(stage_to_rank))):
            raise ValueError(f"stages must be 0..n-1, got {sorted(stage_to_rank)}")
        placement = tuple(stage_to_rank[stage] for stage in range(len(stage_to_rank)))
    else:
        placement = tuple(stage_to_rank)
    used = sorted(set(placement))
    if used != list(range(len(used))):
        raise ValueError(f"every rank 0..p-1 must own a stage, got ranks {used}")
    return placement


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# ----------------------------------------------------------------------------------------------
# Schedule files: JSON read strictly (a file is data)


def _json_int(data: Mapping, key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise KeyError(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r}: must be an integer")
    return value


def _json_list(data: Mapping, key: str, default: list | None = None) -> list:
    value = data.get(key, default)
    if value is None:
        raise KeyError(key)
    if not isinstance(value, list):
        raise ValueError(f"{key}={value!r}: must be a list")
    return value


def _json_ints(data: Mapping, key: str, default: list | None = None) -> list[int]:
    values = _json_list(data, key, default)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{key}: must be a list of integers")
    return values

@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered compute actions for ``num_stages`` stages and ``num_microbatches``.

    ``placement[stage]`` is the pipeline rank that owns ``stage``; ``actions[rank]`` is what that
    rank runs, in order. Construction only checks shapes; ``loom.schedule.validate`` checks the
    rules (completeness, ownership, dependencies, deadlock, memory).

    ``num_routes`` > 1 splits the stages into that many copies of ``stages_per_route`` stages,
    and ``routes[m]`` is the copy microbatch m goes through (see the module docstring; empty
    means route 0 for every microbatch).
    """

    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"
    num_routes: int = 1
    routes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", tuple(int(r) for r in self.placement))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        if len(self.placement) != self.num_stages:
            raise ValueError(
                f"placement has {len(self.placement)} entries, expected num_stages={self.num_stages}"
            )
        if self.placement and max(self.placement) >= len(self.actions):
            raise ValueError(
                f"placement uses rank {max(self.placement)} but actions has {len(self.actions)} ranks"
            )
        object.__setattr__(self, "routes", tuple(int(r) for r in self.routes))
        if self.num_routes < 1 or self.num_stages % self.num_routes:
            raise ValueError(f"num_routes={self.num_routes} must be >= 1 and divide "
                             f"num_stages={self.num_stages}")
        if self.routes and (len(self.routes) != self.num_microbatches
                            or not all(0 <= r < self.num_routes for r in self.routes)):
            raise ValueError(f"routes must give one route in 0..{self.num_routes - 1} per "
                             f"microbatch ({self.num_microbatches}), got {list(self.routes)}")

    @cached_property
    def _positions(self) -> dict[Action, tuple[int, int]]:
        """action -> (rank, index in that rank's list); first occurrence wins. Built on first
        use, once: the search builds many schedules that never look an action up."""
        positions: dict[Action, tuple[int, int]] = {}
        for rank, row in enumerate(self.actions):
            for index, action in enumerate(row):
                positions.setdefault(action, (rank, index))
        return positions

    @property
    def pp_size(self) -> int:
        """Number of pipeline ranks."""
        return len(self.actions)

    @property
    def chunks_per_rank(self) -> int:
        """Stages per rank (the largest count when a custom placement is uneven)."""
        return max(len(self.stages_of(rank)) for rank in range(self.pp_size))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` owns, in increasing order."""
        return self._stages_by_rank.get(rank, ())

    @cached_property
    def _stages_by_rank(self) -> dict[int, tuple[int, ...]]:
        """rank -> its stages, built once: a scan of the placement per rank made a file of
        many ranks quadratic (200,000 ranks: minutes)."""
        stages: dict[int, list[int]] = {}
        for stage, owner in enumerate(self.placement):
            stages.setdefault(owner, []).append(stage)
        return {rank: tuple(owned) for rank, owned in stages.items()}

    def rank_of(self, stage: int) -> int:
        """The rank that owns ``stage``."""
        return self.placement[stage]

    @property
    def stages_per_route(self) -> int:
        """Stages one microbatch goes through (all of them unless the schedule has routes)."""
        return self.num_stages // self.num_routes

    def route_of(self, microbatch: int) -> int:
        """The copy of the stages ``microbatch`` goes through."""
        return self.routes[microbatch] if self.routes else 0

    def route_stages(self, microbatch: int) -> range:
        """The stages ``microbatch`` visits, in order."""
        first = self.route_of(microbatch) * self.stages_per_route
        return range(first, first + self.stages_per_route)

    def is_first(self, stage: int) -> bool:
        """``stage`` starts its route (it takes the tokens)."""
        return stage % self.stages_per_route == 0

    def is_last(self, stage: int) -> bool:
        """``stage`` ends its route (it computes the loss)."""
        return stage % self.stages_per_route == self.stages_per_route - 1

    def stage_weight(self, stage: int) -> Fraction:
        """Activation memory of one microbatch of ``stage``, in units of one full rank's: 1/v
        when the rank owns v stages of ``stage``'s route (a route holds the whole model)."""
        return self.stage_weights[stage]

    @cached_property
    def stage_weights(self) -> tuple[Fraction, ...]:
        """``stage_weight`` of every stage, computed once."""
        per_route = self.stages_per_route
        owned = Counter((rank, stage // per_route) for stage, rank in enumerate(self.placement))
        return tuple(Fraction(1, owned[rank, stage // per_route])
                     for stage, rank in enumerate(self.placement))

    def scaled_stage_weights(self, unit: int) -> tuple[int, ...]:
        """Every stage's weight in units of ``1/unit`` (``unit`` a common denominator), computed
        once per unit: the memory profile of each rank asks for it, and recomputing it per rank
        made a deep pipeline quadratic (4,096 ranks: over a minute)."""
        if unit not in self._scaled_weights:
            self._scaled_weights[unit] = tuple(int(weight * unit)
                                               for weight in self.stage_weights)
        return self._scaled_weights[unit]

    @cached_property
    def _scaled_weights(self) -> dict[int, tuple[int, ...]]:
        return {}

    @cached_property
    def ops_present(self) -> frozenset[Op]:
        """Every op some rank's list holds: one C-level pass per row (the simulator asks the two
        questions below of every schedule, ~2 x 10^5 actions at p = 32 with 8 chunks)."""
        return frozenset().union(*(map(_OP_OF, row) for row in self.actions))

    @cached_property
    def has_transfers(self) -> bool:
        """Whether any rank's list holds offload/reload actions (``Op.O`` / ``Op.R``)."""
        return not self.ops_present.isdisjoint((Op.O, Op.R))

    @cached_property
    def has_vocab_passes(self) -> bool:
        """Whether the output layer runs vocabulary-parallel over the ranks (``Op.S``/``Op.T``)."""
        return not self.ops_present.isdisjoint((Op.S, Op.T))

    def without_vocab_passes(self) -> Schedule:
        """This schedule without its S and T passes: the stages' own compute, what the output
        layer's placement does not change (``self`` when there are none)."""
        if not self.has_vocab_passes:
            return self
        return Schedule(self.num_stages, self.num_microbatches, self.placement,
                        tuple(tuple(a for a in row if not a.op.is_vocab) for row in self.actions),
                        name=self.name, num_routes=self.num_routes, routes=self.routes)

    def compute_only(self) -> Schedule:
        """This schedule without its offload/reload actions: what the compute streams run in
        order (``self`` when there are none). The replay, the search and torch's CSV see this."""
        if not self.has_transfers:
            return self
        return Schedule(self.num_stages, self.num_microbatches, self.placement,
                        tuple(tuple(a for a in row if not a.op.is_transfer)
                              for row in self.actions),
                        name=self.name, num_routes=self.num_routes, routes=self.routes)

    def position(self, action: Action) -> tuple[int, int] | None:
        """``(rank, index)`` of ``action`` in this schedule, or None if it is not scheduled."""
        return self._positions.get(action)

    def __contains__(self, action: object) -> bool:
        return action in self._positions

    def __str__(self) -> str:
        rows = "\n".join(
            f"  rank {rank}: {' '.join(map(str, row))}" for rank, row in enumerate(self.actions)
        )
        routes = (f", {self.num_routes} routes {list(self.routes)}" if self.num_routes > 1
                  else "")
        return (
            f"Schedule {self.name!r}: {self.num_stages} stages, {self.num_microbatches} "
            f"microbatches, placement {list(self.placement)}{routes}\n{rows}"
        )

    # -- JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain data: actions as PyTorch tokens, one list per rank (and the routes, if any)."""
        data = {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.placement),
            "actions": [[str(action) for action in row] for row in self.actions],
        }
        if self.num_routes > 1:
            data.update(num_routes=self.num_routes, routes=list(self.routes))
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> Schedule:
        """The schedule ``to_dict`` wrote. A file is data: each field must have its JSON type
        (a string or a float is not coerced to an integer), else ``ValueError`` names it."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a schedule is a JSON object, not {type(data).__name__}")
        rows = _json_list(data, "actions")
        if not all(isinstance(row, list) and all(isinstance(t, str) for t in row) for row in rows):
            raise ValueError("actions must be a list of rows (one per rank) of action strings")
        num_stages = _json_int(data, "num_stages")
        num_microbatches = _json_int(data, "num_microbatches")
        for key, count in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
            if count < 1:
                raise ValueError(f"{key}={count}: must be >= 1")
        actions = tuple(tuple(Action.parse(t) for t in row) for row in rows)
        for rank, row in enumerate(actions):
            # out-of-range actions are the validator's to report, but on a grid of the declared
            # size: a stage of 10**20 would size it (or overflow an index) first
            for action in row:
                if not (action.stage < num_stages and action.microbatch < num_microbatches):
                    raise ValueError(f"actions: rank {rank}'s {action} is outside num_stages="
                                     f"{num_stages}, num_microbatches={num_microbatches}")
        return cls(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            placement=tuple(_json_ints(data, "placement")),
            actions=actions,
            name=str(data.get("name", "custom")),
            num_routes=_json_int(data, "num_routes", 1),
            routes=tuple(_json_ints(data, "routes", [])),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(loads_json(text))

    # -- PyTorch pipelining CSV -----------------------------------------------------------------

    def to_torch_csv(self, destination: str | os.PathLike | IO[str]) -> None:
        """Write torch's "compute_only" CSV: row r = rank r's actions, one token per cell.

        ``ScheduleMulti._load_csv`` / ``_PipelineScheduleRuntime._load_csv`` read this back.
        The CSV has no room for the name, the microbatch count or the placement: torch infers
        the placement from which row holds a stage, and so does ``from_torch_csv``.

        Routes (``num_routes`` > 1, e.g. ``bidirectional_v``): PyTorch's format cannot hold
        them, so one more row follows the ranks', ``routes=<num_routes>`` and then each
        microbatch's route (``ROUTES_CELL``): Loom's extension, read back by ``from_torch_csv``
        only. Every stage must appear in some row (the placement is inferred from the rows).
        """
        if self.num_routes > 1:
            unused = sorted(set(range(self.num_stages)) - {a.stage for row in self.actions
                                                           for a in row})
            if unused:
                raise ValueError(f"{self.name}: stages {unused} run no action (a route without"
                                 " microbatches), so a CSV cannot place them; export JSON")
        if self.has_transfers:
            raise ValueError(f"{self.name}: torch's CSV has no offload/reload actions (O, R); "
                             "export JSON, or compute_only() for the compute actions")
        if self.has_vocab_passes:
            raise ValueError(f"{self.name}: torch's CSV has no vocabulary-parallel passes (S, T);"
                             " export JSON, or without_vocab_passes() for the stages' actions")
        rows = [[str(action) for action in row] for row in self.actions]
        if self.num_routes > 1:  # Loom's extension: the routes row
            rows.append([f"{ROUTES_CELL}{self.num_routes}", *map(str, self.routes)])
        if isinstance(destination, (str, os.PathLike)):
            with open(destination, "w", newline="") as handle:
                csv.writer(handle).writerows(rows)
        else:
            csv.writer(destination).writerows(rows)

    @classmethod
    def from_torch_csv(
        cls,
        source: str | os.PathLike | IO[str],
        num_microbatches: int | None = None,
        name: str | None = None,
    ) -> Schedule:
        """Read torch's compute-only CSV (see ``from_torch_rows`` for what is accepted), or
        Loom's extension of it for schedules with routes (``to_torch_csv``).

        The CSV carries no name: unless ``name`` is given, a schedule read from a path is named
        after the file (``zbv.csv`` -> ``zbv``, what ``loom schedule export`` writes), and one
        read from an open stream ``torch_csv``.
        """
        if isinstance(source, (str, os.PathLike)):
            if name is None:
                name = os.path.splitext(os.path.basename(os.fspath(source)))[0] or "torch_csv"
            text = io.StringIO(read_input_text(source), newline="")
        else:
            text = source
        try:
            rows = list(csv.reader(text))
        except csv.Error as err:  # e.g. a cell past the csv module's 128 KiB field limit
            raise ValueError(f"not a readable CSV ({err})") from None
        name = "torch_csv" if name is None else name
        return from_torch_rows(rows, num_microbatches=num_microbatches, name=name)


# The first cell of the routes row that ends the CSV of a schedule with routes (Loom's extension)
ROUTES_CELL = "routes="
# Tokens torch's own lowering passes insert; Loom's lowering adds its own, so they are dropped.
_TORCH_BOOKKEEPING = {"REDUCE_GRAD", "UNSHARD", "RESHARD"}
_TORCH_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def from_torch_rows(
    rows: Iterable[Iterable[object]],
    num_microbatches: int | None = None,
    name: str = "torch",
) -> Schedule:
    """Build a Schedule from torch-style rows: a CSV, or ``schedule.pipeline_order.values()``.

    Each cell is anything whose ``str()`` is a torch action token. Empty cells and ``None`` are
    torch's idle steps and are skipped (Loom derives idleness from dependencies).
    ``(a;b)OVERLAP_F_B`` (DualPipeV) is flattened to ``a`` then ``b``; ``REDUCE_GRAD``,
    ``UNSHARD`` and ``RESHARD`` are dropped. SEND/RECV (torch's "compute_comms" format) are
    rejected. The stage count, the placement and (unless given) the microbatch count are
    inferred from the actions, as torch's ``_validate_schedule`` does. A last row starting
    with ``routes=`` (Loom's extension, ``Schedule.to_torch_csv``) gives the routes.
    """
    actions: list[list[Action]] = []
    rows = [list(row) for row in rows]
    num_routes, routes = 1, ()
    if rows and rows[-1] and str(rows[-1][0]).strip().startswith(ROUTES_CELL):
        head, *cells = rows.pop()
        try:
            num_routes = int(str(head).strip()[len(ROUTES_CELL):])
            routes = tuple(int(str(cell)) for cell in cells if str(cell).strip())
        except ValueError:
            raise ValueError(f"cannot read the routes row {[head, *cells]}: expected "
                             f"'{ROUTES_CELL}<count>' and then one route per microbatch") from None
    for rank, row in enumerate(rows):
        parsed: list[Action] = []
        for cell in row:
            token = "" if cell is None else str(cell).strip()
            stage_prefix = token.lstrip("0123456789")
            if not token or stage_prefix in _TORCH_BOOKKEEPING:
                continue
            overlap = _TORCH_OVERLAP.match(token)
            if overlap:
                parsed.extend(Action.parse(part) for part in overlap.group(1).split(";"))
            elif stage_prefix.startswith(("SEND", "RECV")):
                raise ValueError(
                    f"rank {rank}: {token!r} is a communication action; Loom reads torch's "
                    "compute_only CSV format (communication is added by lowering)"
                )
            else:
                parsed.append(Action.parse(token))
        actions.append(parsed)
    every = [action for row in actions for action in row]
    if not every:
        raise ValueError("the torch schedule has no compute actions")
    num_stages = max(action.stage for action in every) + 1
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for action in row:
            owner.setdefault(action.stage, rank)
    if len(owner) < num_stages:  # name the first few: a stage index may be any size
        missing = list(itertools.islice((s for s in itertools.count() if s not in owner), 5))
        raise ValueError(f"{num_stages - len(owner):,} of stages 0..{num_stages - 1} never appear"
                         f" (first {', '.join(map(str, missing))}), so their rank cannot be"
                         " inferred")
    if num_microbatches is None:
        num_microbatches = max(action.microbatch for action in every) + 1
    return Schedule(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        placement=tuple(owner[stage] for stage in range(num_stages)),
        actions=tuple(tuple(row) for row in actions),
        name=name,
        num_routes=num_routes,
        routes=routes,
    )


def csv_text(schedule: Schedule) -> str:
    """The torch CSV of ``schedule`` as a string (handy for diffs and tests)."""
    buffer = io.StringIO()
    schedule.to_torch_csv(buffer)
    return buffer.getvalue()
