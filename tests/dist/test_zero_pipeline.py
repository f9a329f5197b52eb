"""ZeRO-3 inside pipeline stages, and the pipeline's data-parallel bytes, through the real Trainer.

Parity: pp = 2 x dp_shard = 2 (and pp2 x dp_replicate2 x dp_shard2, HSDP) give one process's
loss, gradient norm and every parameter's gradient for 3 steps (fp32) under 1F1B, interleaved
1F1B with 2 stages per rank, and the I/W-split schedules ZB-H1 and ZB-V; with the stages gathered
once per step (``reshard_after_forward = false``) and, for 1F1B, gathered per microbatch.
4 microbatches per pipeline, so every stage accumulates gradients over several backward pieces
before its one reduce-scatter.

Bytes (``metrics.comm``, step 2; the ledger counts what goes through ``comm.py`` and FSDP2's
collectives): pp2 x dp2 all-reduces exactly 2 (d-1)/d x its stages' gradient bytes (plus the
4-byte loss); ZeRO-3 in a pipeline moves the same bytes when the stages are held across the step
and (2m+1)/2 times them when gathered per microbatch; HSDP 2x2's all-reduce over dp_replicate is
2 (r-1)/r x the reduced shard.

Tolerances are test_pipeline_parity.py's (its ``check``): step 1 differs from one process only
by summation order (rtol 1e-5, atol 1e-6); later steps inherit Adam's amplification of
rounding-level elements (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import pytest

from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_pipeline_parity import check, record_pipeline
from tests.dist.test_zero import step_bytes

STEPS = 3
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 1, "optim.warmup_steps": 1,
        "optim.lr": 1e-3, "train.grad_clip": 1.0, "train.eval_batches": 2}
HELD = {"reshard_after_forward": False}
LAYOUTS = {  # name -> (world size, parallel settings)
    "1f1b": (4, {"pp": 2, "dp_shard": 2, "schedule": "1f1b", **HELD}),
    "1f1b-per-microbatch": (4, {"pp": 2, "dp_shard": 2, "schedule": "1f1b",
                                "reshard_after_forward": True}),
    "interleaved-2-chunks": (4, {"pp": 2, "dp_shard": 2, "schedule": "interleaved_1f1b",
                                 "chunks": 2, **HELD}),
    "zb_h1": (4, {"pp": 2, "dp_shard": 2, "schedule": "zb_h1", **HELD}),
    "zbv": (4, {"pp": 2, "dp_shard": 2, "schedule": "zbv", **HELD}),
    "hsdp-1f1b": (8, {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "schedule": "1f1b", **HELD}),
}


@pytest.fixture(scope="module")
def reference(dist, small_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("weights-ref")
    return dist.run(1, record_pipeline, layout_config(BASE, 1), small_data_dir, STEPS,
                    str(out))[0]


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[name for name in LAYOUTS
                                                       if name != "hsdp-1f1b"]))
def test_zero3_pipeline_matches_one_process(dist, small_data_dir, reference, tmp_path, layout):
    """Per step: loss, gradient norm, every gradient; then the validation loss (forward-only
    through the sharded stages) and the saved weights (gathered over dp_shard, then pp)."""
    world, parallel = LAYOUTS[layout]
    results = dist.run(world, record_pipeline, layout_config(BASE, world, **parallel),
                       small_data_dir, STEPS, str(tmp_path))
    check(reference, results, layout)


# -- bytes (step 2 of each rank, tests.dist.test_zero.step_bytes) ---------------------------------


def test_pipeline_data_parallel_all_reduce_is_counted_and_equals_the_ring_volume(
        dist, small_data_dir):
    d = 2
    config = layout_config({**BASE, "metrics.comm": True}, 4, pp=2, dp_replicate=d)
    for rank, (records, params, _) in enumerate(dist.run(4, step_bytes, config, small_data_dir)):
        wire = records["dp/all_reduce"][1]
        expected = 2 * (d - 1) / d * (4 * params + 4)  # the stages' gradients once, the loss
        assert wire / expected == 1.0, f"rank {rank}: {wire} counted, {expected} expected"


@pytest.mark.parametrize("held", [True, False], ids=["held", "per-microbatch"])
def test_zero3_pipeline_bytes(dist, small_data_dir, held):
    """Held across the step: one all-gather and one reduce-scatter of each stage per step, the
    bytes of plain data parallelism's all-reduce; per microbatch: FSDP2 gathers for each of the
    m forwards and m backwards, (2m+1)/2 times that."""
    d, m = 2, 4
    config = layout_config({**BASE, "metrics.comm": True}, 4, pp=2, dp_shard=d,
                           reshard_after_forward=not held)
    for rank, (records, params, _) in enumerate(dist.run(4, step_bytes, config, small_data_dir)):
        moved = records["dp_shard/all_gather"][1] + records["dp_shard/reduce_scatter"][1]
        ratio = moved / (2 * (d - 1) / d * 4 * params)
        # FSDP2 pads each parameter's dim 0 to a multiple of d; the debug model's are all even.
        assert ratio == pytest.approx(1.0 if held else (2 * m + 1) / 2, rel=1e-12), \
            f"rank {rank}: {records}"


def test_hsdp_replicate_all_reduce_is_counted(dist, small_data_dir):
    """HSDP 2 x 2: FSDP2 reduce-scatters over dp_shard, then all-reduces the 1/d shard over
    dp_replicate (r = 2): 2 (r-1)/r x 4P/d bytes per rank per step."""
    r, d = 2, 2
    config = layout_config({**BASE, "metrics.comm": True, "train.micro_batch_size": 2}, 4,
                           dp_replicate=r, dp_shard=d)
    for rank, (records, params, _) in enumerate(dist.run(4, step_bytes, config, small_data_dir)):
        calls, wire = records["dp_replicate/all_reduce"]
        assert calls == 5, f"rank {rank}: one per FSDP unit (4 blocks and the root)"
        assert wire / (2 * (r - 1) / r * 4 * params / d) == 1.0, f"rank {rank}: {records}"
