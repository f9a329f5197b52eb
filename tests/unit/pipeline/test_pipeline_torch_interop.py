"""Interoperability with torch.distributed.pipelining (torch 2.13), without processes.

torch's schedule classes compute ``pipeline_order`` for every rank in their constructors; they only
read ``num_stages``, ``group_size``, ``group_rank``, ``stage_index`` and ``submod`` from the stage
objects, so light fake stages suffice. ``_PipelineScheduleRuntime._load_csv`` then runs torch's own
``_validate_schedule`` and its lowering passes (``_add_send_recv`` fails on an order that cannot
make progress), and ``_simulate_comms_compute`` dry-runs the lowered schedule with communication.
"""

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from loom.schedule import Action, Op, Schedule, ScheduleError, from_torch_rows, validate
from loom.pipeline.torch_orders import FakeStage, pipeline_order
from loom.schedule.families import get, names

torch.set_num_threads(1)


def imported(schedule_class, p, m, chunks, name="torch"):
    order = pipeline_order(schedule_class, chunks, p, m)
    return from_torch_rows((order[rank] for rank in sorted(order)), num_microbatches=m, name=name)


# (Loom family, its kwargs, torch class, stages per rank)
SAME_ORDER = [
    ("gpipe", {}, torch_schedules.ScheduleGPipe, 1),
    ("interleaved_1f1b", {"chunks": 2}, torch_schedules.ScheduleInterleaved1F1B, 2),
    ("interleaved_1f1b", {"chunks": 3}, torch_schedules.ScheduleInterleaved1F1B, 3),
    ("looped_bfs", {"chunks": 2}, torch_schedules.ScheduleLoopedBFS, 2),
    # torch's interleaved zero bubble with one stage per rank is exactly ZB-H1
    ("zb_h1", {}, torch_schedules.ScheduleInterleavedZeroBubble, 1),
    ("zbv", {}, torch_schedules.ScheduleZBVZeroBubble, 2),
    # torch's (F;B)OVERLAP_F_B pairs flatten to F then B, which is how Loom writes them
    ("dualpipev", {}, torch_schedules.ScheduleDualPipeV, 2),
]


def torch_accepted_counts(family, p):
    # torch's interleaved schedules need m to be a multiple of max(1, m // p); these all are.
    # DualPipeV needs m >= 2p.
    if family == "dualpipev":
        return (2 * p, 2 * p + 1, 4 * p)
    return (p, p + 1, 2 * p, 4 * p)


@pytest.mark.parametrize("p", (2, 4, 8))
@pytest.mark.parametrize("family, kwargs, torch_class, chunks", SAME_ORDER,
                         ids=[f"{row[0]}-v{row[3]}" for row in SAME_ORDER])
def test_loom_generates_the_same_order_as_torch(family, kwargs, torch_class, chunks, p):
    for m in torch_accepted_counts(family, p):
        theirs = imported(torch_class, p, m, chunks)
        ours = get(family)(p, m, **kwargs)
        assert ours.placement == theirs.placement, (family, p, m)
        assert ours.actions == theirs.actions, (family, p, m)


@pytest.mark.parametrize("p", (2, 4, 8))
def test_torch_1f1b_order_has_an_off_by_one_on_the_last_rank_that_loom_catches(p):
    # torch 2.13's Schedule1F1B._get_pipeline_order starts the last rank (no warm-up) at
    # microbatch 1, so its order names a microbatch that does not exist. The order is only
    # informational there (Schedule1F1B runs its own loop), but Loom's validator rejects it.
    # With that rank's forwards renumbered from 0 it is exactly Loom's 1F1B.
    m = 2 * p
    theirs = imported(torch_schedules.Schedule1F1B, p, m, 1)
    with pytest.raises(ScheduleError) as caught:
        validate(theirs)
    assert caught.value.rule == "range" and f"microbatch {m} does not exist" in caught.value.reason
    fixed_last = tuple(
        Action(a.stage, a.op, a.microbatch - 1) if a.op is Op.F else a for a in theirs.actions[-1]
    )
    assert get("1f1b")(p, m).actions == (*theirs.actions[:-1], fixed_last)


TORCH_ONLY = [
    (torch_schedules.ScheduleInterleavedZeroBubble, 2),
]


@pytest.mark.parametrize("p", (2, 4, 8))
@pytest.mark.parametrize("torch_class, chunks", TORCH_ONLY, ids=lambda x: getattr(x, "__name__", x))
def test_torch_orders_imported_into_loom_pass_loom_validation(torch_class, chunks, p):
    for m in (2 * p, 4 * p):
        validate(imported(torch_class, p, m, chunks))


def load_in_torch(schedule: Schedule, path):
    """Write Loom's CSV and load it with torch's runtime; returns the runtime."""
    schedule.to_torch_csv(path)
    chunks = schedule.chunks_per_rank
    stages = [FakeStage(stage, schedule.num_stages, schedule.pp_size) for stage in schedule.stages_of(0)]
    assert len(stages) == chunks
    runtime = torch_schedules._PipelineScheduleRuntime(stages, schedule.num_microbatches)
    runtime._load_csv(str(path), format="compute_only")
    return runtime


@pytest.mark.parametrize("family", names())
@pytest.mark.parametrize("p, m", [(2, 4), (4, 9), (8, 16)])
def test_loom_csv_loads_validates_lowers_and_simulates_in_torch(family, p, m, tmp_path):
    schedule = get(family)(p, m)
    runtime = load_in_torch(schedule, tmp_path / f"{family}.csv")
    # torch read back exactly our actions and inferred our placement
    assert from_torch_rows(runtime.pipeline_order[r] for r in range(p)).actions == schedule.actions
    assert [runtime.stage_index_to_group_rank[s] for s in range(schedule.num_stages)] == list(schedule.placement)
    # its lowering added the sends/receives, and its dry run with communication completes
    lowered = runtime.pipeline_order_with_comms
    assert any("SEND_F" in str(action) for row in lowered.values() for action in row)
    # runtime._simulate() itself raises on the UNSHARD/RESHARD/REDUCE_GRAD that torch's own
    # lowering inserts, so dry-run the lowered order without those bookkeeping actions.
    bookkeeping = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
    with_comms = {
        rank: [a for a in row if a.computation_type.value not in bookkeeping]
        for rank, row in lowered.items()
    }
    simulated = torch_schedules._simulate_comms_compute(
        with_comms, lambda stage: runtime.stage_index_to_group_rank[stage], schedule.num_stages
    )
    assert {str(a) for row in simulated.values() for a in row if a is not None} >= {
        str(a) for row in schedule.actions for a in row
    }


def test_torch_rejects_a_csv_that_loom_rejects(tmp_path):
    schedule = get("1f1b")(2, 2)
    broken = Schedule(2, 2, schedule.placement, (schedule.actions[0][:-1], schedule.actions[1]))
    with pytest.raises(AssertionError, match="backward"):
        load_in_torch(broken, tmp_path / "broken.csv")
