"""ZeRO with mixture-of-experts models and expert parallelism, through the real Trainer.

* MoE with dp_shard > 1 and ep = 1: experts are ordinary parameters, sharded over dp_shard like
  the rest (ZeRO-1/2 flat buckets, ZeRO-3 FSDP2 units per block).
* ep > 1 with dp_shard > 1: dense weights shard over dp_shard x ep flattened, expert weights
  (this ep rank's experts) over dp_shard; every gradient ends divided by dp x ep although the
  experts are reduced over dp_shard only (each rank's expert gradient already sums the tokens
  of all ep ranks). ZeRO-3 gives the experts their own FSDP2 unit on the dp_shard mesh.

Parity with one process (3 steps, fp32: loss, gradient norm, every gradient), dropless and with a
capacity factor that drops assignments; HSDP (dp_replicate2 x dp_shard2 x ep2, 8 ranks); with tp,
cp (ep = 1) and pp (1F1B, ZB-V), and ep2 with tp2 (ZeRO-1, ZeRO-2 + SP, ZeRO-3), ring cp2 (ZeRO-2/3:
dense weights over dp_shard x ep x cp, experts over dp_shard x cp) and pp2 (ZeRO-2/3), 8 ranks; the ledger's bytes per group; bit-exact resume and checkpoints resharded to and from
one process and plain expert parallelism.

Tolerances as in test_zero.py: step 1 differs from one process only by summation order (rtol
1e-5, atol 1e-6); later steps inherit Adam's amplification of rounding-level elements (rtol 1e-4,
atol 1e-5, justified in tests/dist/test_data_parallel.py).
"""

from __future__ import annotations

import pytest

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_zero import ATOL, ATOL_FIRST, RTOL, RTOL_FIRST

STEPS = 3
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "tiny-moe", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "optim.lr": 1e-3, "train.grad_clip": 1.0}
ROUTING = {"dropless": {}, "capacity-1.0": {"model.capacity_factor": 1.0}}

LAYOUTS = {  # name -> (world size, parallel settings); tiny-moe has 4 experts
    "zero1-dp2": (2, {"dp_shard": 2, "zero_stage": 1}),
    "zero2-dp2": (2, {"dp_shard": 2, "zero_stage": 2}),
    "zero3-dp2": (2, {"dp_shard": 2, "zero_stage": 3}),
    "zero1-dp2-ep2": (4, {"dp_shard": 2, "ep": 2, "zero_stage": 1}),
    "zero2-dp2-ep2": (4, {"dp_shard": 2, "ep": 2, "zero_stage": 2}),
    "zero3-dp2-ep2": (4, {"dp_shard": 2, "ep": 2, "zero_stage": 3}),
}
HSDP = {  # 8 ranks: dp_replicate2 x dp_shard2 x ep2
    "zero2-hsdp-2x2-ep2": {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "zero_stage": 2},
    "zero3-hsdp-2x2-ep2": {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "zero_stage": 3},
}


@pytest.fixture(scope="module")
def references(dist, small_data_dir):
    return {name: dist.run(1, record_training, layout_config({**BASE, **extra}, 1),
                           small_data_dir, STEPS)[0] for name, extra in ROUTING.items()}


def check(reference: dict, results: list, label: str) -> None:
    for rank, result in enumerate(results):
        where = f"{label} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=where)


@pytest.mark.parametrize("layout, routing", matrix(
    [(layout, routing) for routing in ROUTING for layout in LAYOUTS],
    # CI: every ZeRO stage with ep, ZeRO-3 without (FSDP2 over the experts' own weights), and
    # capacity routing once (the matrix: ZeRO-1/2 without ep, capacity at every stage)
    ci=[(layout, "dropless") for layout in LAYOUTS if layout not in ("zero1-dp2", "zero2-dp2")]
    + [("zero3-dp2-ep2", "capacity-1.0")]))
def test_zero_with_experts_matches_one_process(dist, small_data_dir, references, layout,
                                               routing):
    world, parallel = LAYOUTS[layout]
    config = layout_config({**BASE, **ROUTING[routing]}, world, **parallel)
    check(references[routing], dist.run(world, record_training, config, small_data_dir, STEPS),
          f"{layout} {routing}")


@pytest.mark.parametrize("layout", matrix(HSDP, ci=["zero2-hsdp-2x2-ep2"]))
def test_hsdp_with_experts_matches_one_process(dist, small_data_dir, layout):
    """8 data-parallel ranks: one sequence per rank, so one-sequence microbatches (for the
    reference too)."""
    base = {**BASE, "train.micro_batch_size": 1}
    reference = dist.run(1, record_training, layout_config(base, 1), small_data_dir, STEPS)[0]
    config = layout_config(base, 8, **HSDP[layout])
    check(reference, dist.run(8, record_training, config, small_data_dir, STEPS), layout)


COMPOSED = {  # name -> (world size, parallel settings): ZeRO of an MoE model with tp, cp, pp
    "zero1-dp2-tp2": (4, {"dp_shard": 2, "tp": 2, "zero_stage": 1}),
    "zero3-dp2-tp2": (4, {"dp_shard": 2, "tp": 2, "zero_stage": 3}),
    "zero2-dp2-cp2-ring": (4, {"dp_shard": 2, "cp": 2, "cp_mode": "ring", "zero_stage": 2}),
    "zero3-dp2-cp2-ulysses": (4, {"dp_shard": 2, "cp": 2, "cp_mode": "ulysses",
                                  "zero_stage": 3}),
    "zero1-pp2-dp2-1f1b": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1, "schedule": "1f1b"}),
    "zero2-pp2-dp2-zbv": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 2, "schedule": "zbv"}),
    "zero3-pp2-dp2-1f1b": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 3, "schedule": "1f1b"}),
    "zero1-dp2-ep2-tp2": (8, {"dp_shard": 2, "ep": 2, "tp": 2, "zero_stage": 1}),
    "zero3-dp2-ep2-tp2": (8, {"dp_shard": 2, "ep": 2, "tp": 2, "zero_stage": 3}),
    "zero2-dp2-ep2-tp2-sp": (8, {"dp_shard": 2, "ep": 2, "tp": 2, "zero_stage": 2,
                                 "sequence_parallel": True}),
    "zero2-dp2-ep2-cp2-ring": (8, {"dp_shard": 2, "ep": 2, "cp": 2, "cp_mode": "ring",
                                   "zero_stage": 2}),
    "zero3-dp2-ep2-cp2-ring": (8, {"dp_shard": 2, "ep": 2, "cp": 2, "cp_mode": "ring",
                                   "zero_stage": 3}),
    "zero2-pp2-dp2-ep2-1f1b": (8, {"pp": 2, "dp_shard": 2, "ep": 2, "zero_stage": 2,
                                   "schedule": "1f1b"}),
    "zero3-pp2-dp2-ep2-1f1b": (8, {"pp": 2, "dp_shard": 2, "ep": 2, "zero_stage": 3,
                                   "schedule": "1f1b"}),
}


@pytest.mark.parametrize("layout", matrix(COMPOSED, ci=[  # zero3 x tp: the matrix
    "zero2-dp2-cp2-ring", "zero2-pp2-dp2-zbv"]))
def test_zero_with_experts_composed_matches_one_process(dist, small_data_dir, references,
                                                        layout):
    world, parallel = COMPOSED[layout]
    config = layout_config(BASE, world, **parallel)
    check(references["dropless"], dist.run(world, record_training, config, small_data_dir,
                                           STEPS), layout)


# -- checkpoints (tests.dist.test_checkpoint_resume's helpers) -------------------------------------

CKPT_LAYOUTS = {  # name -> (world size, parallel settings)
    "single": (1, {}),
    "ep2": (2, {"ep": 2, "dp_replicate": 1}),
    **{name: LAYOUTS[name] for name in ("zero1-dp2", "zero3-dp2", "zero1-dp2-ep2",
                                        "zero2-dp2-ep2", "zero3-dp2-ep2")},
    **{name: COMPOSED[name] for name in ("zero1-dp2-ep2-tp2", "zero3-dp2-ep2-tp2",
                                         "zero2-pp2-dp2-ep2-1f1b")},
}


def ckpt_config(layout: str) -> tuple[int, dict]:
    from tests.dist.test_checkpoint_experts import BASE as CKPT_BASE

    world, parallel = CKPT_LAYOUTS[layout]
    return world, layout_config(CKPT_BASE, world, **parallel)


@pytest.mark.parametrize("layout", matrix(["zero2-dp2-ep2", "zero3-dp2-ep2", "zero1-dp2",
                                           "zero1-dp2-ep2-tp2"],
                                          ci=["zero2-dp2-ep2"]))
def test_zero_with_experts_resumes_bit_exact(dist, small_data_dir, tmp_path, layout):
    from tests.dist.test_checkpoint_resume import check_resume

    world, config = ckpt_config(layout)
    check_resume(dist, small_data_dir, tmp_path, world, config, layout)


@pytest.mark.parametrize("source, target", matrix([("zero1-dp2-ep2", "single"),
                                            ("single", "zero2-dp2-ep2"),
                                            ("zero3-dp2-ep2", "single"),
                                            ("single", "zero3-dp2-ep2"),
                                            ("zero2-dp2-ep2", "zero3-dp2-ep2"),
                                            ("zero3-dp2-ep2", "ep2"),
                                            ("ep2", "zero1-dp2-ep2"),
                                            ("zero3-dp2", "zero1-dp2-ep2"),
                                            ("zero2-pp2-dp2-ep2-1f1b", "single"),
                                            ("zero1-dp2-ep2-tp2", "zero3-dp2-ep2"),
                                            ("zero3-dp2-ep2-tp2", "zero1-dp2-ep2")],
                                                   ci=[("zero3-dp2", "zero1-dp2-ep2")]))
def test_zero_with_experts_checkpoint_reshards(dist, small_data_dir, tmp_path, source, target):
    from tests.dist.test_checkpoint_resume import check_reshard

    check_reshard(dist, small_data_dir, tmp_path, ckpt_config(source), ckpt_config(target),
                  f"{source} -> {target}")


def ledger_of_step_2(ctx, config_table, data_dir):
    """Step 2's ledger, ``"axis/op" -> (calls, wire bytes)`` (test_zero.step_bytes)."""
    from tests.dist.test_zero import step_bytes

    return step_bytes(ctx, config_table, data_dir)[0]


def test_zero_with_experts_moves_the_ring_volume_of_each_group(dist, small_data_dir):
    """dp_shard2 x ep2: dense weights move 2 (n-1)/n x 4 P_dense over dp_shard x ep (n = 4),
    this rank's experts 2 (d-1)/d x 4 P_experts / ep over dp_shard (d = 2) under ZeRO-2 (one
    reduce-scatter and one all-gather), 1.5x that under ZeRO-3 (FSDP2 gathers in forward and
    backward); counted by the ledger (step 2, one microbatch per step)."""
    from loom.config import from_dict
    from loom.models import build_model
    from loom.parallel.expert import expert_parameter_names
    from loom.config import model_args

    base = {**BASE, "metrics.comm": True, "train.micro_batch_size": 2}
    for stage, ratio in ((2, 1.0), (3, 1.5)):
        config = layout_config(base, 4, dp_shard=2, ep=2, zero_stage=stage)
        model = build_model(model_args(from_dict(config)), device="meta")
        experts = expert_parameter_names(model)
        dense = sum(p.numel() for n, p in model.named_parameters() if n not in experts)
        local_experts = sum(p.numel() for n, p in model.named_parameters() if n in experts) // 2
        for rank, records in enumerate(dist.run(4, ledger_of_step_2, config, small_data_dir)):
            for axis, n, psi in (("dp_shard_ep", 4, dense), ("dp_shard", 2, local_experts)):
                moved = records[f"{axis}/reduce_scatter"][1] + records[f"{axis}/all_gather"][1]
                assert moved / (2 * (n - 1) / n * 4 * psi) == pytest.approx(ratio, rel=0.01), \
                    f"ZeRO-{stage} rank {rank} {axis}: {records}"
