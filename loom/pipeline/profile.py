"""Measure a real pipeline run: per-action timings, saved-activation bytes, and what they feed.

``PipelineRecorder`` is the optional hook of ``PipelineRuntime`` (``runtime.recorder = ...``;
``None``, the default, costs one ``is not None`` test per action). The runtime calls

* ``step_begin()`` / ``step_end()`` around each ``step``,
* ``begin(action)`` once the action's input has arrived (so a blocked receive is idle time, not
  compute) and ``end(action)`` after its compute and after its send was posted.

Times are ``time.perf_counter()``: on Linux that is ``CLOCK_MONOTONIC``, one clock for every
process of the machine, so timelines of different ranks line up without a clock exchange. (Across
machines the ranks' clocks would have to be aligned first; not needed here.)

With ``track_memory=True`` the recorder also installs ``torch.autograd.graph.saved_tensors_hooks``
during every F and counts the bytes of tensors autograd saves for backward, once per storage
(several ops save the same input) and without parameters or buffers. Each saved storage is wrapped
in a small object whose deletion — when autograd frees the saved variable, at the end of the
backward piece that releases it — takes its bytes off the live total, so the curve is what is
really held, not what a rule says should be. What a stage keeps for W beyond autograd's saved
tensors (``PipelineStage.held_for_weight``: the deferred matmuls' inputs and output gradients)
is handed to ``end`` of the I and counted the same way, once per storage, until its W ends. It
records the bytes each F saved and what is still held after each I (Zero Bubble's M_W / M_B),
per (stage, microbatch).

The functions below turn recordings (one ``RankProfile`` per rank, plain picklable data) into
``StageCosts`` for the simulator (calibration), a measured ``SimResult`` that ``render_gantt``
draws like a simulated one, and a Chrome / Perfetto trace in the simulator's palette.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.validate import dependencies
from loom.schedule.cost import OpCosts, StageCosts
from loom.schedule.render import chunk_of, rank_metadata, to_chrome_trace, trace_event
from loom.schedule.simulate import SimResult, Slot


@dataclass
class StepProfile:
    """One ``step`` on one rank: its span and every action's (token, start, end), in run order."""

    begin: float = 0.0
    end: float = 0.0
    actions: list[tuple[str, float, float]] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (time, live saved bytes)


@dataclass
class RankProfile:
    """Everything one rank recorded; plain data, returned from worker processes."""

    rank: int
    steps: list[StepProfile] = field(default_factory=list)
    forward_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, mb) -> F
    after_input_grad: dict[tuple[int, int], int] = field(default_factory=dict)  # held after I


class _Saved:
    """What the pack hook returns: keeps the tensor, and un-counts its storage when freed."""

    __slots__ = ("tensor", "key", "recorder")

    def __init__(self, tensor: torch.Tensor, key: int, recorder: PipelineRecorder) -> None:
        self.tensor, self.key, self.recorder = tensor, key, recorder

    def __del__(self) -> None:
        self.recorder._release(self.key)


class PipelineRecorder:
    """Records what ``PipelineRuntime`` does on one rank (see the module docstring)."""

    def __init__(self, rank: int, *, track_memory: bool = False,
                 modules: Iterable[torch.nn.Module] = ()) -> None:
        self.profile = RankProfile(rank)
        self.track_memory = track_memory
        # Parameters and buffers (RoPE tables) are saved by reference, not activations.
        self._skip = {t.untyped_storage().data_ptr() for m in modules
                      for t in (*m.parameters(), *m.buffers())}
        self._live: dict[int, list] = {}  # storage ptr -> [references, bytes, (stage, mb)]
        self._live_by_owner: dict[tuple[int, int], int] = defaultdict(int)
        self._held: dict[tuple[int, int], list[int]] = {}  # (stage, mb) -> storages held for W
        self._live_total = 0
        self._owner: tuple[int, int] = (-1, -1)
        self._hooks: Any = None
        self._start = 0.0
        self._step: StepProfile | None = None

    # -- called by the runtime --------------------------------------------------------------------
    def step_begin(self) -> None:
        self._step = StepProfile(begin=time.perf_counter())
        if self.track_memory:
            self._step.memory.append((self._step.begin, self._live_total))

    def step_end(self) -> None:
        step, self._step = self._step, None
        step.end = time.perf_counter()
        self.profile.steps.append(step)

    def begin(self, action: Action) -> None:
        self._start = time.perf_counter()
        if self.track_memory and action.op is Op.F:
            self._owner = (action.stage, action.microbatch)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()

    def end(self, action: Action, held: Iterable[torch.Tensor] = ()) -> None:
        """After ``action``; for an I, ``held`` is what the stage keeps for the W beyond
        autograd's saved tensors (counted until that W ends)."""
        now = time.perf_counter()
        self._step.actions.append((str(action), self._start, now))
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            self.profile.forward_bytes[self._owner] = self._live_by_owner[self._owner]
        elif self.track_memory and action.op is Op.I:
            key = (action.stage, action.microbatch)
            self._hold(key, held)
            self.profile.after_input_grad[key] = self._live_by_owner[key]
        elif self.track_memory and action.op is Op.W:
            for storage in self._held.pop((action.stage, action.microbatch), ()):
                self._release(storage)

    # -- saved-tensor accounting ------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or storage.nbytes() == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, storage.nbytes(), self._owner]
            self._change(entry[2], entry[1])
        entry[0] += 1
        # Keep a detached alias (same storage and version counter): an op that saves its own
        # output would otherwise hold output -> grad_fn -> saved variable -> this object ->
        # output, a cycle through C++ that no collector sees, so the pieces a split backward
        # never runs (I retains the graph, W runs only the weight paths) would never be freed.
        # Backward reads only the data; double backward through a recorded F is not supported.
        return _Saved(tensor.detach(), key, self)

    def _hold(self, owner: tuple[int, int], tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors``' storages (once each) for ``owner`` until its W ends. A storage
        autograd still holds is shared, not counted twice: the last release un-counts it."""
        keys: list[int] = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._skip or storage.nbytes() == 0 or key in keys:
                continue
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [0, storage.nbytes(), owner]
                self._change(owner, entry[1])
            entry[0] += 1
            keys.append(key)
        self._held[owner] = keys

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:  # pragma: no cover - freed after the recorder was reset
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self._change(entry[2], -entry[1])

    def _change(self, owner: tuple[int, int], delta: int) -> None:
        self._live_by_owner[owner] += delta
        self._live_total += delta
        if self._step is not None:
            self._step.memory.append((time.perf_counter(), self._live_total))


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


# ------------------------------------------------------------------------------------------------
# From recordings to the simulator's inputs and outputs


def _timed(profiles: Sequence[RankProfile], steps: Iterable[int]):
    """(rank, action, start, end) of the given steps on every rank."""
    for profile in profiles:
        for index in steps:
            for token, start, end in profile.steps[index].actions:
                yield profile.rank, Action.parse(token), start, end


def measured_latency(schedule: Schedule, profiles: Sequence[RankProfile], step: int) -> float:
    """Median delay from a producer's end to a blocked consumer's start across ranks.

    Only transfers the consumer actually waited for count (its rank was idle before the producer
    finished), so the sample is send + wake-up time, not time spent on other work.
    """
    finished = {action: end for _, action, _, end in _timed(profiles, [step])}
    samples = []
    for profile in profiles:
        row = profile.steps[step].actions
        previous_end = profile.steps[step].begin
        for token, start, end in row:
            action = Action.parse(token)
            for dep in dependencies(schedule, action):
                if schedule.rank_of(dep.stage) != profile.rank:
                    produced = finished[dep]
                    if produced > previous_end:  # the rank was free: it waited for this message
                        samples.append(start - produced)
            previous_end = end
    # A sample can be slightly negative: the receiver may run before the sender, descheduled
    # right after posting its send, takes its end time.
    return max(0.0, statistics.median(samples)) if samples else 0.0


def calibrate(schedule: Schedule, profiles: Sequence[RankProfile], steps: Sequence[int],
              **options: Any) -> StageCosts:
    """Per-stage mean F, I, W (and B) durations of ``steps``, plus the median measured latency,
    as ``StageCosts`` (seconds). Ops a schedule does not use are filled so that ``B = I + W``
    (a B-only schedule gets I = W = B/2; they are never asked for)."""
    durations: dict[tuple[int, Op], list[float]] = defaultdict(list)
    for _, action, start, end in _timed(profiles, steps):
        durations[action.stage, action.op].append(end - start)
    mean = {key: statistics.fmean(values) for key, values in durations.items()}
    stages = []
    for stage in range(schedule.num_stages):
        f = mean[stage, Op.F]
        if (stage, Op.B) in mean:
            b = mean[stage, Op.B]
            stages.append(OpCosts(f, b / 2, b / 2, b))
        else:
            stages.append(OpCosts(f, mean[stage, Op.I], mean[stage, Op.W]))
    latency = statistics.median(measured_latency(schedule, profiles, s) for s in steps)
    return StageCosts(tuple(stages), latency=latency, source="measured", **options)


def measured_result(schedule: Schedule, profiles: Sequence[RankProfile], step: int, *,
                    bytes_per_unit: float = 1.0) -> SimResult:
    """Step ``step`` as a ``SimResult`` (times in seconds from the earliest rank's step start),
    memory in units of ``bytes_per_unit`` saved bytes, so ``render_gantt`` can draw it."""
    t0 = min(p.steps[step].begin for p in profiles)
    timeline, memory = [], []
    for profile in sorted(profiles, key=lambda p: p.rank):
        record = profile.steps[step]
        timeline.append(tuple(Slot(Action.parse(token), s - t0, e - t0)
                              for token, s, e in record.actions))
        points = [(0.0, 0.0)] + [(t - t0, level / bytes_per_unit) for t, level in record.memory]
        memory.append(tuple(points))
    return SimResult(schedule.name, schedule.num_stages, schedule.num_microbatches,
                     schedule.placement, tuple(timeline), tuple(memory), costs="measured")


def peak_saved_bytes(profile: RankProfile, step: int) -> int:
    """Largest live saved-tensor bytes of one rank during ``step`` (needs ``track_memory``)."""
    return max((level for _, level in profile.steps[step].memory), default=0)


def chrome_trace(schedule: Schedule, profiles: Sequence[RankProfile], step: int,
                 predicted: SimResult | None = None) -> dict[str, Any]:
    """Trace-event JSON of a measured step, one process per rank, coloured like the simulator's
    traces (``trace_event``); with ``predicted``, the simulated ranks follow as processes
    ``p .. 2p-1`` on the same time axis, so the two timelines sit one above the other."""
    t0 = min(p.steps[step].begin for p in profiles)
    events: list[dict[str, Any]] = []
    for profile in profiles:
        events.extend(rank_metadata(profile.rank, "measured rank"))
        for token, start, end in profile.steps[step].actions:
            action = Action.parse(token)
            events.append(trace_event(profile.rank, action, (start - t0) * 1e6, (end - start) * 1e6,
                                      chunk_of(schedule.placement, action.stage)))
        for t, level in profile.steps[step].memory:
            events.append({"name": "saved activations", "ph": "C", "pid": profile.rank,
                           "ts": (t - t0) * 1e6, "args": {"bytes": level}})
    if predicted is not None:
        offset = len(profiles)
        for event in to_chrome_trace(predicted)["traceEvents"]:
            event = {**event, "pid": event["pid"] + offset}
            if event.get("name") == "process_sort_index":
                event["args"] = {"sort_index": event["pid"]}
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": schedule.name, "step": step}}


# ------------------------------------------------------------------------------------------------
# Ranks that share cores: what ``loom.schedule.simulate`` does not model


def uncontended_work(profiles: Sequence[RankProfile], step: int, cores: float) -> dict[Action, float]:
    """Each action's duration had it had a core to itself, assuming the busy ranks shared
    ``cores`` equally while it ran (processor sharing): the integral of min(1, cores / busy)
    over its measured interval, where busy counts the ranks inside an action at each instant."""
    intervals = [(start, end, action) for _, action, start, end in _timed(profiles, [step])]
    edges = sorted({t for start, end, _ in intervals for t in (start, end)})
    work = {}
    for start, end, action in intervals:
        total = 0.0
        cuts = [t for t in edges if start < t < end]
        for left, right in zip([start, *cuts], [*cuts, end]):
            middle = (left + right) / 2
            busy = sum(1 for s, e, _ in intervals if s <= middle < e)
            total += (right - left) * min(1.0, cores / max(busy, 1))
        work[action] = total
    return work
