"""ZeRO composed with the other parallelisms, through the real Trainer: parity with one process
(3 steps, fp32: loss, gradient norm, every gradient) and bit-exact resume from a checkpoint.

* ZeRO-3 (FSDP2) and ZeRO-1/2 with context parallelism: the shard group is dp_shard x cp
  flattened (cp ranks hold the same weights; their gradients are averaged with the
  data-parallel ones), HSDP adds dp_replicate.
* ZeRO-1/2 inside pipeline stages: each stage reduce-scatters its buckets after its last
  backward piece (the runtime's ``flush``), one optimizer steps every stage's slices, the
  clipping norm sums the slices' squares over the shard group, then over pp. Checked with the
  pipeline tests' ``check`` (per-step numbers, validation loss, saved weights) under 1F1B, ZB-V
  (I/W split, two stages per rank) and interleaved 1F1B.
* ZeRO-1/2 with tensor parallelism: the buckets hold each rank's local tp shards (a DTensor's
  local tensor becomes a view of the bucket), reduce-scattered over the dp_shard ranks of the
  same tp coordinate; the clipping norm sums tp-sharded squares over tp and counts replicated
  parameters once. With and without sequence and vocabulary parallelism.
* ZeRO-1 and ZeRO-3 inside pipeline stages with TP (pp2 x dp_shard2 x tp2, 8 ranks).

Tolerances as in test_zero.py: step 1 differs from one process only by summation order (rtol
1e-5, atol 1e-6); later steps inherit Adam's amplification of rounding-level elements (rtol 1e-4,
atol 1e-5, justified in tests/dist/test_data_parallel.py).
"""

from __future__ import annotations

import pytest

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import matrix
from tests.dist.test_pipeline_parity import check, record_pipeline
from tests.dist.test_zero import ATOL, ATOL_FIRST, BASE, RTOL, RTOL_FIRST, STEPS
from tests.dist.test_zero_pipeline import BASE as PIPE_BASE

RING = {"cp": 2, "cp_mode": "ring"}

LAYOUTS = {  # name -> (world size, parallel settings)
    "zero3-dp2-cp2-ring": (4, {"dp_shard": 2, "zero_stage": 3, **RING}),
    "zero1-dp2-cp2-ring": (4, {"dp_shard": 2, "zero_stage": 1, **RING}),
    "zero2-dp2-cp2-ring": (4, {"dp_shard": 2, "zero_stage": 2, **RING}),
    "hsdp-2x2-cp2-ulysses": (8, {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3, "cp": 2,
                                 "cp_mode": "ulysses"}),
    "zero1-dp2-tp2": (4, {"dp_shard": 2, "zero_stage": 1, "tp": 2}),
    "zero2-dp2-tp2-sp-vocab": (4, {"dp_shard": 2, "zero_stage": 2, "tp": 2,
                                   "sequence_parallel": True, "vocab_parallel": True}),
}


@pytest.fixture(scope="module")
def reference(dist, small_data_dir):
    return dist.run(1, record_training, layout_config(BASE, 1), small_data_dir, STEPS)[0]


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[name for name in LAYOUTS
                                                       if name not in ("zero1-dp2-tp2",
                                                                       "hsdp-2x2-cp2-ulysses")]))
def test_zero_composition_matches_one_process(dist, small_data_dir, reference, layout):
    world, parallel = LAYOUTS[layout]
    config = layout_config(BASE, world, **parallel)
    for rank, result in enumerate(dist.run(world, record_training, config, small_data_dir,
                                           STEPS)):
        label = f"{layout} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)


PIPELINES = {  # name -> (world size, parallel settings); 4 microbatches per pipeline
    "zero1-pp2-dp2-1f1b": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1, "schedule": "1f1b"}),
    "zero2-pp2-dp2-zbv": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 2, "schedule": "zbv"}),
    "zero1-pp2-dp2-interleaved": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1,
                                      "schedule": "interleaved_1f1b", "chunks": 2}),
}


@pytest.fixture(scope="module")
def pipe_reference(dist, small_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("weights-ref")
    return dist.run(1, record_pipeline, layout_config(PIPE_BASE, 1), small_data_dir, STEPS,
                    str(out))[0]


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_zero12_pipeline_matches_one_process(dist, small_data_dir, pipe_reference, tmp_path,
                                             layout):
    world, parallel = PIPELINES[layout]
    results = dist.run(world, record_pipeline, layout_config(PIPE_BASE, world, **parallel),
                       small_data_dir, STEPS, str(tmp_path))
    check(pipe_reference, results, layout)


PLAIN_PP_TP = {"pp": 2, "dp_replicate": 2, "tp": 2, "schedule": "1f1b"}
PIPELINES_TP = {  # 8 ranks: pp2 x dp_shard2 x tp2
    "zero1-pp2-dp2-tp2-1f1b": {"pp": 2, "dp_shard": 2, "tp": 2, "zero_stage": 1,
                               "schedule": "1f1b"},
    "zero3-pp2-dp2-tp2-1f1b": {"pp": 2, "dp_shard": 2, "tp": 2, "zero_stage": 3,
                               "schedule": "1f1b", "reshard_after_forward": False},
}


@pytest.fixture(scope="module")
def plain_pp_tp(dist, small_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("weights-pp-tp")
    return dist.run(8, record_pipeline, layout_config(PIPE_BASE, 8, **PLAIN_PP_TP),
                    small_data_dir, STEPS, str(out))[0]


@pytest.mark.parametrize("layout", matrix(PIPELINES_TP, ci=[]))
def test_zero_pipeline_with_tp_matches(dist, small_data_dir, pipe_reference, plain_pp_tp,
                                       tmp_path, layout):
    """pp2 x dp_shard2 x tp2: loss, gradient norm and every gradient of 3 steps, and the
    validation loss, against one process; the saved weights against plain data parallelism of
    the same shape (pp2 x dp_replicate2 x tp2), with step 1's tight tolerance.

    Why the weights are not compared with one process here: after 5 steps (measured when this test ran 5) that plain layout
    (accepted, tested for 2 steps in test_pipeline_parity.py) itself differs from one process in
    one element of 4096 of layers.3.attention.wo.weight by 1.7e-5 (atol 1e-5): Adam's
    amplification of a rounding-level gradient element, measured identically with and without
    ZeRO. ZeRO-1 and ZeRO-3 here differ from that layout by at most 7.5e-9 in any weight and
    3e-8 in any gradient (measured)."""
    import torch

    results = dist.run(8, record_pipeline,
                       layout_config(PIPE_BASE, 8, **PIPELINES_TP[layout]), small_data_dir,
                       STEPS, str(tmp_path))
    for rank, result in enumerate(results):
        where = f"{layout} rank {rank}"
        assert_parity(pipe_reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(pipe_reference, result, rtol=RTOL, atol=ATOL, label=where)
        torch.testing.assert_close(torch.tensor(result["val_loss"]),
                                   torch.tensor(pipe_reference["val_loss"]), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"{where} validation loss: {m}")
    saved, expected = results[0]["weights"], plain_pp_tp["weights"]
    assert set(saved) == set(expected) == set(pipe_reference["weights"])
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m, n=name: f"{layout} saved {n}: {m}")


# -- checkpoints of the new layouts (tests.dist.test_checkpoint_resume's helpers) ------------------

RESUMES = {  # name -> (world size, parallel settings)
    "zero3-dp2-cp2-ring": LAYOUTS["zero3-dp2-cp2-ring"],
    "zero2-dp2-cp2-ring": LAYOUTS["zero2-dp2-cp2-ring"],
    "zero2-pp2-dp2-zbv": PIPELINES["zero2-pp2-dp2-zbv"],
    "zero1-dp2-tp2": LAYOUTS["zero1-dp2-tp2"],
    "zero2-dp2-tp2-sp-vocab": LAYOUTS["zero2-dp2-tp2-sp-vocab"],
    "zero1-pp2-dp2-tp2-1f1b": (8, PIPELINES_TP["zero1-pp2-dp2-tp2-1f1b"]),
}


def resume_config(layout: str) -> tuple[int, dict]:
    from tests.dist.test_checkpoint_resume import BASE as CKPT_BASE

    world, parallel = RESUMES[layout]
    return world, layout_config(CKPT_BASE, world, **parallel)


# tp-SP checkpoints: test_checkpoint_matrix.py's tp2-sp-dp2 target; ZeRO-2 and pipeline resumes
# run in test_checkpoint_resume.py (zero2-hsdp-2x2, pp2-zbv, pp2-zero3-dp2), so all in the matrix
@pytest.mark.parametrize("layout", matrix(RESUMES, ci=[]))
def test_zero_composition_resumes_bit_exact(dist, small_data_dir, tmp_path, layout):
    from tests.dist.test_checkpoint_resume import check_resume

    world, config = resume_config(layout)
    check_resume(dist, small_data_dir, tmp_path, world, config, layout)


@pytest.mark.parametrize("source, target", matrix([("zero2-dp2-cp2-ring", "single"),
                                            ("zero3-dp2-cp2-ring", "zero2-pp2-dp2-zbv"),
                                            ("zero2-pp2-dp2-zbv", "zero3-dp2-cp2-ring"),
                                            ("zero1-dp2-tp2", "single"),
                                            ("zero3-dp2-cp2-ring", "zero2-dp2-tp2-sp-vocab"),
                                            ("zero2-dp2-tp2-sp-vocab", "zero1-dp2-tp2")],
                                                   # CI: each composition on one side
                                                   ci=[("zero2-pp2-dp2-zbv", "zero3-dp2-cp2-ring"),
                                                       ("zero3-dp2-cp2-ring",
                                                        "zero2-dp2-tp2-sp-vocab")]))
def test_zero_composition_checkpoint_reshards(dist, small_data_dir, tmp_path, source, target):
    from tests.dist.test_checkpoint_resume import check_reshard, config_for

    ends = [(1, config_for("single")) if name == "single" else resume_config(name)
            for name in (source, target)]
    check_reshard(dist, small_data_dir, tmp_path, ends[0], ends[1], f"{source} -> {target}")


def test_zero_over_dp_shard_x_cp_moves_the_ring_volume_of_four_ranks(dist, small_data_dir):
    """dp_shard2 x cp2 shards over 4 ranks: ZeRO-2's reduce-scatter + all-gather move
    2 (n-1)/n x 4Ψ with n = 4 (plain data parallelism's volume over dp x cp), ZeRO-3's 1.5x that;
    counted by the ledger on the ``dp_shard_cp`` axis (step 2, one microbatch per step)."""
    from tests.dist.test_zero import step_bytes

    n = 4
    base = {**BASE, "metrics.comm": True, "train.micro_batch_size": 4}
    for stage, ratio in ((2, 1.0), (3, 1.5)):
        config = layout_config(base, 4, dp_shard=2, zero_stage=stage, **RING)
        for rank, (records, _, psi) in enumerate(dist.run(4, step_bytes, config,
                                                          small_data_dir)):
            moved = records["dp_shard_cp/reduce_scatter"][1] + \
                records["dp_shard_cp/all_gather"][1]
            # flat buckets (ZeRO-2) and FSDP2's dim-0 shards are padded to a multiple of n
            assert moved / (2 * (n - 1) / n * 4 * psi) == pytest.approx(ratio, rel=0.01), \
                f"ZeRO-{stage} rank {rank}: {records}"
