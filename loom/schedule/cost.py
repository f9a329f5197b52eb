"""Pipeline costs for the simulator: per-stage op durations, send times and activation memory.

``StageCosts`` is what ``loom.schedule.simulate`` needs to replay a schedule: how long F, I, W and B
of every (global) stage take, how long a point-to-point send between two ranks takes, and how
much activation memory a (stage, microbatch) holds between its forward and its backward.

Units. Durations are plain numbers in one time unit of your choice (seconds by convention: the
planner and measured runs use seconds, and ``render.to_chrome_trace`` assumes them unless told
otherwise). Pass ints or ``fractions.Fraction`` to get exact results, which the closed-form tests
rely on. Memory is in the issue's units: one full pipeline rank's activations for one microbatch
is 1, so a stage on a rank that owns v stages weighs 1/v (the same accounting as
``loom.schedule.validate.memory_profile``).

Scope. This file is the *pipeline* part of the cost model. The planner's ``CostModel`` (compute
from FLOPs and device peak, communication from bytes and links, memory from the model formulas of
REFERENCE.md) is a separate, later piece; it is meant to produce a ``StageCosts`` for a layout,
e.g. ``CostModel.stage_costs(layout) -> StageCosts``, and may live next to it in this file.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Rational, Real
from typing import Any

from loom.errors import loads_json, read_input_text
from loom.schedule.ir import Action, Op, Schedule

Number = Real  # int, float or Fraction; arithmetic keeps whatever exactness the inputs have


@dataclass(frozen=True)
class OpCosts:
    """Durations of one stage's ops. ``b`` (full backward) defaults to ``i + w``."""

    f: Number
    i: Number
    w: Number
    b: Number | None = None

    def __post_init__(self) -> None:
        for name in ("f", "i", "w", "b"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"op cost {name.upper()} must be >= 0, got {value}")

    def of(self, op: Op) -> Number:
        if op is Op.F:
            return self.f
        if op is Op.I:
            return self.i
        if op is Op.W:
            return self.w
        return self.i + self.w if self.b is None else self.b


@dataclass(frozen=True)
class StageCosts:
    """Per-stage op durations, send time and activation memory for ``simulate``.

    ``stages`` holds one ``OpCosts`` per global stage index, or a single entry that applies to
    every stage (what ``uniform`` builds). A send between two ranks takes ``latency`` plus
    ``message_bytes / bandwidth`` when a bandwidth is given; the same activation-sized message
    goes forward (F to F) and back (input gradient to I/B). Sends on the same rank cost nothing.

    ``activation[stage]`` is the memory a (stage, microbatch) holds from the start of its F;
    ``None`` means the issue's units (1/v for a stage on a rank with v stages). With a split
    backward, ``weight_grad_fraction`` of it is still held after I until W ends (Zero Bubble's
    M_W / M_B); the rest is freed when I ends. The default 1 holds everything until W, which is
    the issue's (and the validator's) accounting.
    """

    stages: tuple[OpCosts, ...]
    latency: Number = 0
    bandwidth: Number | None = None
    message_bytes: Number = 0
    activation: tuple[Number, ...] | None = None
    weight_grad_fraction: Number = 1
    # PipeOffload's host link (``loom.schedule.offload``): bytes/s between device and host
    # memory, each direction, and the bytes of one activation unit (one full rank's activations
    # of one microbatch). Offloading (stage, microbatch) moves ``activation_weight`` units.
    # None: transfers are not priced (they take no time).
    host_bandwidth: Number | None = None
    host_unit_bytes: Number = 0
    # Where the numbers came from (a file path, "uniform", ...), shown by the CLI and in JSON.
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("StageCosts needs at least one stage's op costs")
        if self.activation is not None:
            object.__setattr__(self, "activation", tuple(self.activation))
        if self.latency < 0:
            raise ValueError(f"latency must be >= 0, got {self.latency}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 (or None), got {self.bandwidth}")
        if self.host_bandwidth is not None and self.host_bandwidth <= 0:
            raise ValueError(f"host_bandwidth must be > 0 (or None), got {self.host_bandwidth}")
        if not 0 <= self.weight_grad_fraction <= 1:
            raise ValueError(
                f"weight_grad_fraction must be in [0, 1], got {self.weight_grad_fraction}"
            )

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def uniform(
        cls, f: Number, i: Number, w: Number, latency: Number = 0, *, b: Number | None = None,
        **options: Any,
    ) -> StageCosts:
        """The same F, I, W (and B = I + W unless given) on every stage."""
        return cls(stages=(OpCosts(f, i, w, b),), latency=latency, source="uniform", **options)

    @classmethod
    def per_stage(
        cls,
        f: Sequence[Number],
        i: Sequence[Number],
        w: Sequence[Number],
        b: Sequence[Number | None] | None = None,
        latency: Number = 0,
        **options: Any,
    ) -> StageCosts:
        """One F, I, W (and optionally B) per global stage index."""
        if not len(f) == len(i) == len(w) == len(b if b is not None else f):
            raise ValueError("per_stage: f, i, w (and b) need one entry per stage")
        backwards = b if b is not None else [None] * len(f)
        stages = tuple(OpCosts(*costs) for costs in zip(f, i, w, backwards))
        return cls(stages=stages, latency=latency, source="per_stage", **options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageCosts:
        """``{"stages": [{"F": 1, "I": 1, "W": 1, "B": 2?}, ...], "latency": 0, ...}``."""
        if not isinstance(data, Mapping) or not isinstance(data.get("stages"), (list, tuple)):
            raise ValueError('expected {"stages": [{"F": ..., "I": ..., "W": ...}, ...], ...},'
                             f" got a {type(data).__name__}"
                             + (" without a stages list" if isinstance(data, Mapping) else ""))
        stages = tuple(_op_costs(row, where=f"stages[{n}]") for n, row in enumerate(data["stages"]))
        options: dict[str, Any] = {}
        for key in _OPTIONS:
            value = data.get(key)
            if value is None:
                continue
            if key == "activation":
                if not isinstance(value, (list, tuple)):  # a number or a string would iterate
                    raise ValueError(f"activation: expected a list of one number per stage, got"
                                     f" {value!r:.40}")
                options[key] = tuple(_number(v, f"activation[{n}]") for n, v in enumerate(value))
            else:
                options[key] = _number(value, key)
        return cls(stages=stages, source=str(data.get("source", "")), **options)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> StageCosts:
        """Read per-stage costs from JSON (``from_dict``'s shape) or CSV.

        The CSV has a header with columns ``F``, ``I``, ``W`` and optionally ``B``, ``stage``
        (ignored; rows are stages in order) and ``activation``. ``overrides`` (e.g.
        ``latency=0.1``) replace what the file says.
        """
        path = os.fspath(path)
        text = read_input_text(path)  # InputFileError (a ValueError) for a device, FIFO, ...
        if path.endswith(".json"):
            data = loads_json(text)
        else:
            try:
                rows = list(csv.DictReader(io.StringIO(text, newline="")))
            except csv.Error as err:  # e.g. a cell past the csv module's 128 KiB field limit
                raise ValueError(f"{path}: not a readable CSV ({err})") from None
            data = {"stages": rows}
            if rows and rows[0].get("activation") not in (None, ""):
                data["activation"] = [_number(row["activation"], "activation") for row in rows]
        if isinstance(data, Mapping):  # (anything else: from_dict names what it expected)
            data = {**data, **overrides, "source": path}
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (numbers as floats), readable by ``from_dict``."""
        stages = []
        for costs in self.stages:
            row = {"F": float(costs.f), "I": float(costs.i), "W": float(costs.w)}
            if costs.b is not None:
                row["B"] = float(costs.b)
            stages.append(row)
        data: dict[str, Any] = {"stages": stages, "source": self.source}
        for key in _OPTIONS:
            value = getattr(self, key)
            if value is not None:
                data[key] = [float(v) for v in value] if key == "activation" else float(value)
        return data

    # -- what the simulator asks ----------------------------------------------------------------

    def check(self, schedule: Schedule) -> None:
        """Raise ValueError unless these costs cover every stage of ``schedule``."""
        n = schedule.num_stages
        if len(self.stages) not in (1, n):
            raise ValueError(f"costs give {len(self.stages)} stages, the schedule has {n}")
        if self.activation is not None and len(self.activation) != n:
            raise ValueError(f"activation gives {len(self.activation)} stages, schedule has {n}")

    def op_costs(self, stage: int) -> OpCosts:
        return self.stages[0] if len(self.stages) == 1 else self.stages[stage]

    def duration(self, action: Action) -> Number:
        """How long ``action`` keeps its rank busy."""
        return self.op_costs(action.stage).of(action.op)

    def message_time(self) -> Number:
        """How long one activation-sized message between two ranks takes (the delay between an
        action finishing and an action on another rank being able to use its output)."""
        if self.bandwidth is None:
            return self.latency
        return self.latency + _divide(self.message_bytes, self.bandwidth)

    def activation_weight(self, schedule: Schedule, stage: int) -> Number:
        """Memory held by one microbatch of ``stage`` (default 1/v of a full rank's, v the
        rank's stages on that stage's route: ``Schedule.stage_weight``)."""
        if self.activation is not None:
            return self.activation[stage]
        return schedule.stage_weight(stage)

    def transfer_time(self, schedule: Schedule, stage: int) -> Number:
        """How long offloading (or reloading) one microbatch's activations of ``stage`` takes on
        the host link: ``activation_weight * host_unit_bytes / host_bandwidth`` (0 unpriced)."""
        if self.host_bandwidth is None:
            return 0
        return _divide(self.activation_weight(schedule, stage) * self.host_unit_bytes,
                       self.host_bandwidth)

    def describe(self) -> str:
        """Short human form, e.g. ``F=1 I=1 W=1 latency=0`` (per-stage costs: the source)."""
        if len(self.stages) == 1:
            c = self.stages[0]
            text = f"F={_fmt(c.f)} I={_fmt(c.i)} W={_fmt(c.w)}"
            text += "" if c.b is None else f" B={_fmt(c.b)}"
        else:
            text = f"{len(self.stages)} per-stage costs from {self.source or 'a list'}"
        text += f" latency={_fmt(self.latency)}"
        if self.bandwidth is not None:
            text += f" bytes={_fmt(self.message_bytes)} bandwidth={_fmt(self.bandwidth)}"
        return text


_OPTIONS = ("latency", "bandwidth", "message_bytes", "activation", "weight_grad_fraction",
            "host_bandwidth", "host_unit_bytes")


def _divide(a: Number, b: Number) -> Number:
    """``a / b``, exact when both are ints or Fractions (``/`` on two ints gives a float)."""
    if isinstance(a, Rational) and isinstance(b, Rational):
        result = Fraction(a) / Fraction(b)
        return int(result) if result.denominator == 1 else result
    return a / b


def _fmt(value: Number) -> str:
    return f"{float(value):g}"


# The largest cost a file or --costs may give (any unit; only ratios matter to a schedule)
MAX_COST = 10**15


_EXPONENT = re.compile(r"[eE]\s*([+-]?\d+)\s*$")
MAX_COST_CHARS = 64


def _number(text: Any, where: str) -> Number:
    """Parse a number, keeping decimals exact (``"0.1"`` becomes 1/10, not a float); numbers
    pass as they are. At most ``MAX_COST`` in size (sums of larger ones overflow a float in the
    simulator), finite, and not a bool."""
    if isinstance(text, bool) or (isinstance(text, float) and not math.isfinite(text)):
        raise ValueError(f"{where}: expected a finite number, got {text!r}")
    value: Number
    if isinstance(text, (int, float, Fraction)):
        value = text
    else:
        shown = str(text).strip()
        # Fraction("1e999999999") builds 10**999999999 (hours) before any size check could run
        exponent = _EXPONENT.search(shown)
        if len(shown) > MAX_COST_CHARS or (exponent and abs(int(exponent.group(1))) > 300):
            raise ValueError(f"{where}: expected a number of at most {MAX_COST_CHARS} characters"
                             f" and an exponent within +-300, got {shown[:40]!r}")
        try:
            parsed = Fraction(shown)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{where}: expected a number, got {text!r}") from None
        value = int(parsed) if parsed.denominator == 1 else parsed
    if abs(value) > MAX_COST:
        raise ValueError(f"{where}: {text!r} is larger than {MAX_COST:.0e} (costs are relative:"
                         " scale them down)")
    return value


def _op_costs(row: Mapping[str, Any], where: str) -> OpCosts:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected an object with F, I and W, got {row!r:.40}")
    upper = {str(k).strip().upper(): v for k, v in row.items()}
    missing = [op for op in "FIW" if upper.get(op) in (None, "")]
    if missing:
        raise ValueError(f"{where}: missing op cost(s) {', '.join(missing)}")
    b = upper.get("B")
    return _timed(OpCosts(
        _number(upper["F"], f"{where}.F"),
        _number(upper["I"], f"{where}.I"),
        _number(upper["W"], f"{where}.W"),
        None if b in (None, "") else _number(b, f"{where}.B"),
    ), where)


def _timed(costs: OpCosts, where: str) -> OpCosts:
    """``costs`` unless a stage's work takes no time at all (F, I, W and B all 0): its
    microbatches would be live for no time, so the memory curve (frees before allocations at one
    instant) would never count them and every schedule would report a peak of 0."""
    if not (costs.f or costs.i or costs.w or costs.b):
        raise ValueError(f"{where}: F, I and W are all 0; a stage must take some time (costs are"
                         " relative: 1,1,1 is the unit profile)")
    return costs


def full_stage_costs(costs: StageCosts, schedule: Schedule) -> StageCosts:
    """``costs`` given per *full stage* (a rank's share of the model when it holds one stage),
    turned into per-stage costs of ``schedule``: a stage on a rank that holds v stages of its
    route gets 1/v of them (``Schedule.stage_weight``, the memory accounting's share too).

    ``costs`` holds one entry (every rank alike) or one per rank. This is the one meaning of the
    CLI's ``--costs`` in ``show``, ``simulate`` and ``search`` (whose
    ``loom.schedule.search.placement_costs`` checks its inputs and calls this), so that the
    same flag draws the same per-chunk durations whatever the schedule's chunk count.
    """
    pp = schedule.pp_size
    if len(costs.stages) not in (1, pp):
        raise ValueError(f"full-stage costs: give one F,I,W for every rank or one per rank "
                         f"({pp}), got {len(costs.stages)}")
    stages = []
    made: dict[tuple[int, Fraction], OpCosts] = {}  # by (rank's entry, share): computed once
    for stage, rank in enumerate(schedule.placement):
        entry = 0 if len(costs.stages) == 1 else rank
        share = schedule.stage_weight(stage)
        scaled = made.get((entry, share))
        if scaled is None:
            full = costs.stages[entry]
            scaled = made[entry, share] = OpCosts(*(None if x is None else _scaled(x, share)
                                                    for x in (full.f, full.i, full.w, full.b)))
        stages.append(scaled)
    return dataclasses.replace(costs, stages=tuple(stages))


def _scaled(value: Number, share: Fraction) -> Number:
    """``value * share``, exact for ints and Fractions (an int when the result is whole)."""
    if share == 1:
        return value
    if isinstance(value, Rational):
        result = Fraction(value) * share
        return int(result) if result.denominator == 1 else result
    return value * float(share)


def parse_cost_spec(text: str) -> StageCosts:
    """``"F,I,W"`` or ``"F,I,W,LATENCY"`` (the CLI's ``--costs``) as uniform costs."""
    parts = [part for part in text.split(",")]
    if len(parts) not in (3, 4):
        raise ValueError(f"expected F,I,W or F,I,W,LATENCY, got {text!r}")
    numbers = [_number(part, name) for part, name in zip(parts, ("F", "I", "W", "LATENCY"))]
    _timed(OpCosts(*numbers[:3]), text)
    return StageCosts.uniform(*numbers)
