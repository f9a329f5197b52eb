"""Data parallelism is one process, split: 1, 2 and 4 ranks give the same loss and gradients.

Same model (debug preset), seed and data; 3 optimizer steps, fp32. Microbatch sizes differ between
layouts on purpose, so gradient accumulation is exercised against the all-reduce as well.
"""

from pathlib import Path

import pytest

from loom.config import from_dict
from loom.schedule.ir import Op
from loom.testing.parity import assert_parity, layout_config, record_training
from loom.train.trainer import Trainer
from tests.conftest import SMALL_DATA_OVERRIDES

STEPS = 3
BASE = {
    **SMALL_DATA_OVERRIDES,
    "model.preset": "debug",
    "train.steps": STEPS,
    "train.global_batch_size": 8,
    "optim.warmup_steps": 2,
    "optim.lr": 1e-3,
    "train.grad_clip": 1.0,
}
# Step 1 starts from identical weights: layouts differ only in summation order (microbatch
# accumulation vs all-reduce average), ~3e-7 of the largest gradient.
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
# Later steps: Adam divides each gradient element by its own RMS, so an element whose gradient is
# at rounding level moves by up to ~lr either way, and the next gradients inherit that. Measured
# on this model: <= 2e-5 of the largest gradient (~0.2) after 5 steps at dp=4.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def reference(dist, small_data_dir):
    config = layout_config({**BASE, "train.micro_batch_size": 2}, 1)
    return dist.run(1, record_training, config, small_data_dir, STEPS)[0]


@pytest.mark.parametrize("world, micro", [(2, 2), (2, 4), (4, 1)])
def test_data_parallel_matches_one_process(dist, small_data_dir, reference, world, micro):
    config = layout_config({**BASE, "train.micro_batch_size": micro}, world, dp_replicate=world)
    results = dist.run(world, record_training, config, small_data_dir, STEPS)
    for rank, result in enumerate(results):
        label = f"dp={world} micro={micro} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)


def test_the_loss_actually_moves(reference):
    # Guards the parity test against comparing two runs that did nothing.
    assert reference["loss"][-1] < reference["loss"][0] - 0.1


def buckets_launched_before_the_flush(ctx, config_table: dict, data_dir: str) -> list:
    """Per stage of this rank: the op of its last backward piece in the schedule, and how many
    of its reducer's buckets were already on the wire when the runtime flushed it after that
    piece."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    runtime = trainer.pipeline
    row = runtime.schedule.actions[runtime.pp_rank]
    seen = {}  # the runtime's flush comes first (finish() flushes again, launching nothing)
    for index, stage in runtime.stages.items():
        last_op = [a.op for a in row if a.stage == index and a.op in (Op.B, Op.W)][-1]
        reducer = stage.applied.reducer
        flush = reducer.flush

        def recording_flush(reducer=reducer, flush=flush, last_op=last_op, index=index):
            seen.setdefault(index, (last_op.name, reducer._next, len(reducer.buckets)))
            flush()

        reducer.flush = recording_flush
    trainer.train_step()
    return list(seen.values())


@pytest.mark.parametrize("pp, schedule", [(1, "1f1b"), (2, "1f1b"), (2, "zbv")])
def test_the_reduction_overlaps_the_last_full_backward(dist, small_data_dir, pp, schedule):
    """A stage whose last backward piece is a full B reduces each bucket inside it, as soon as
    its gradients are ready (DDP's overlap; at pp = 1 the whole step's reduction), so every
    bucket is already launched when the runtime flushes; after a W (Zero Bubble's weight
    gradient) the flush launches them all."""
    config = layout_config({**BASE, "train.micro_batch_size": 2, "train.grad_bucket_mb": 0.05,
                            "parallel.schedule": schedule}, 2 * pp, dp_replicate=2, pp=pp)
    ops = set()
    for seen in dist.run(2 * pp, buckets_launched_before_the_flush, config, small_data_dir):
        for op, launched, buckets in seen:
            assert buckets > 1
            assert launched == (buckets if op == "B" else 0), seen
            ops.add(op)
    assert ops == ({"W"} if schedule == "zbv" else {"B"})
