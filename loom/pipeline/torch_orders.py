"""``torch.distributed.pipelining``'s own schedules as Loom ``Schedule``s, for comparison.

Each torch schedule class computes its per-rank action order (``pipeline_order``) in its
constructor from a few attributes of its stages; ``FakeStage`` supplies them, so no process or
model is needed. ``torch_schedule`` turns that order into a validated Loom schedule
(``loom.schedule.from_torch_rows``), which the simulator, the validator and the schedule search's
tests and benchmarks compare against Loom's own (tests/unit/schedule/test_search_torch.py,
tests/unit/pipeline/test_pipeline_torch_interop.py, bench/schedules.py).

torch 2.13's ``Schedule1F1B`` order names a microbatch that does not exist on its last rank (an
off-by-one: its runtime runs its own loop, not that order); that order is repaired here, and
equals Loom's ``1f1b``. Here, on the torch side of the schedule (floor of the pipeline runtime),
because importing torch's schedules imports torch.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as ts

from loom.schedule import Action, Op, Schedule, ScheduleError, from_torch_rows, validate

# Every schedule class torch ships (single-stage and multi-stage per rank)
TORCH_CLASSES: tuple[type, ...] = tuple(getattr(ts, name) for name in ts.__all__
                                        if name.startswith("Schedule"))


class FakeStage:
    """The attributes torch's schedule constructors read from a pipeline stage."""

    def __init__(self, stage_index: int, num_stages: int, pp_size: int, rank: int = 0):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = pp_size, rank
        self.submod = None
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1


def pipeline_order(cls: type, chunks: int, p: int, m: int) -> dict[int, list]:
    """torch's ``pipeline_order`` of ``cls`` for ``p`` ranks, ``m`` microbatches and ``chunks``
    stages per rank (constructed on rank 0's fake stages); torch's own errors propagate."""
    num_stages = p * chunks
    if chunks == 1 and issubclass(cls, ts.PipelineScheduleSingle):
        return cls(FakeStage(0, num_stages, p), m).pipeline_order
    return cls([FakeStage(i, num_stages, p) for i in range(chunks)], m).pipeline_order


def torch_schedule(cls: type, chunks: int, p: int, m: int) -> Schedule | None:
    """torch's order as a validated Loom schedule named ``torch:<class>`` (``(v=chunks)`` above
    one stage per rank); None where torch refuses the sizes or its order does not validate."""
    try:
        order = pipeline_order(cls, chunks, p, m)
    except Exception:  # noqa: BLE001  (torch raises assorted errors for sizes it does not take)
        return None
    name = f"torch:{cls.__name__.removeprefix('Schedule')}" + (f"(v={chunks})" if chunks > 1
                                                                else "")
    schedule = from_torch_rows((order[r] for r in sorted(order)), num_microbatches=m, name=name)
    if cls is ts.Schedule1F1B:  # repair the last rank's off-by-one (module docstring)
        last = tuple(Action(a.stage, a.op, a.microbatch - 1) if a.op is Op.F else a
                     for a in schedule.actions[-1])
        schedule = Schedule(schedule.num_stages, m, schedule.placement,
                            (*schedule.actions[:-1], last), name)
    try:
        validate(schedule)
    except ScheduleError:
        return None
    return schedule


__all__ = ["FakeStage", "TORCH_CLASSES", "pipeline_order", "torch_schedule"]
