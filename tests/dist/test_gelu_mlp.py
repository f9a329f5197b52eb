"""A GELU-MLP (GPT-style, ``model.mlp = "gelu"``) model under tensor parallelism (with and
without sequence parallelism) and pipeline parallelism trains exactly as one process does.

Same harness and tolerances as tests/dist/test_layouts_parity.py: the debug preset (4 query and
4 key/value heads) with a GELU MLP of hidden size 4·dim, 2 optimizer steps, fp32. Under tp the
plan splits ``w1`` by columns and ``w2`` by rows, with no ``w3`` (loom.parallel.tensor).

GELU experts (the tiny MoE preset with ``mlp = "gelu"``: routed and shared experts are
``w2(gelu(w1 x))``): expert parallelism (ep 2, 4), expert tensor parallelism with SP, ZeRO-3
over dp_shard x ep and a 1F1B pipeline x ep train exactly as one process does.
"""

import pytest

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_kv_heads": 4,
        "model.mlp": "gelu", "model.ffn_dim": 256,
        "train.steps": STEPS, "train.global_batch_size": 8, "train.micro_batch_size": 2,
        "optim.warmup_steps": 1, "optim.lr": 1e-3, "train.grad_clip": 1.0}
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5

LAYOUTS = {
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2, "schedule": "1f1b"}),
}


@pytest.fixture(scope="module")
def reference(dist, small_data_dir):
    return dist.run(1, record_training, layout_config(BASE, 1), small_data_dir, STEPS)[0]


def test_reference_is_a_gelu_mlp(reference):
    """The one-process run trains w1 and w2 only: a SwiGLU run (w3) would make the parity below
    say nothing about the GELU MLP."""
    names = set(reference["grads"][0])
    assert "layers.0.feed_forward.w1.weight" in names
    assert "layers.0.feed_forward.w2.weight" in names
    assert not any(".w3." in name for name in names), sorted(names)
    assert reference["grads"][0]["layers.0.feed_forward.w1.weight"].shape == (256, 64)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gelu_layout_matches_one_process(dist, small_data_dir, reference, layout):
    world, parallel = LAYOUTS[layout]
    config = layout_config(BASE, world, **parallel)
    for rank, result in enumerate(dist.run(world, record_training, config, small_data_dir, STEPS)):
        label = f"gelu {layout} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)


# -- GELU experts (an MoE model with mlp = "gelu": GShard's, Megatron's GPT MoE) ----------------
MOE = {**SMALL_DATA_OVERRIDES, "model.preset": "tiny-moe", "model.mlp": "gelu",
       "train.steps": STEPS, "train.global_batch_size": 8, "train.micro_batch_size": 2,
       "optim.warmup_steps": 1, "optim.lr": 1e-3, "train.grad_clip": 1.0}
MOE_LAYOUTS = {
    "ep2": (2, {"ep": 2, "dp_replicate": 1}),
    # expert tensor parallelism: every expert's w1 by columns, w2 by rows, no w3 to split
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "zero3-dp2-ep2": (4, {"dp_shard": 2, "ep": 2, "dp_replicate": 1, "zero_stage": 3}),
    "pp2-ep2": (4, {"pp": 2, "ep": 2, "dp_replicate": 1, "schedule": "1f1b"}),
    "ep4": (4, {"ep": 4, "dp_replicate": 1}),
}


@pytest.fixture(scope="module")
def moe_reference(dist, small_data_dir):
    return dist.run(1, record_training, layout_config(MOE, 1), small_data_dir, STEPS)[0]


def test_the_moe_reference_has_gelu_experts(moe_reference):
    names = set(moe_reference["grads"][0])
    assert any(name.endswith("experts.w1") for name in names)
    assert any(name.endswith("experts.w2") for name in names)
    assert not any("w3" in name for name in names), sorted(names)
    assert moe_reference["loss"][-1] < moe_reference["loss"][0]


@pytest.mark.parametrize("layout", matrix(MOE_LAYOUTS, ci=["ep2", "tp2-sp", "zero3-dp2-ep2"]))
def test_gelu_experts_match_one_process(dist, small_data_dir, moe_reference, layout):
    world, parallel = MOE_LAYOUTS[layout]
    config = layout_config(MOE, world, **parallel)
    for rank, result in enumerate(dist.run(world, record_training, config, small_data_dir, STEPS)):
        label = f"gelu experts {layout} rank {rank}"
        assert_parity(moe_reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(moe_reference, result, rtol=RTOL, atol=ATOL, label=label)
