"""What each recomputation policy runs again (``loom.sim.recompute_cost``), the one statement
both the layer's backward seconds and the step's hardware FLOPs are priced from."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS
from loom.sim.recompute_cost import recomputed

MODEL = PRESETS["llama3-8b"]  # 32 layers, h 4096, 32 heads, 8 KV heads, FFN 14336


@pytest.mark.parametrize("policy, every, share", [("none", 2, 0.0), ("full", 2, 1.0),
                                                  ("every_k", 2, 0.5), ("every_k", 3, 11 / 32)])
def test_whole_blocks_run_again_in_the_share_the_policy_picks(policy, every, share):
    redo = recomputed(Layout(recompute=policy, recompute_every=every), "core", MODEL, 8, 1,
                      False)
    assert redo.forward_share == share
    assert not redo.attention_core and not redo.elementwise and redo.matmul_flops == 0


def test_selective_means_the_core_or_the_op_level_policy_by_framework():
    """Megatron's selective recomputes the attention core; torchtitan's runs its even matmuls
    (wk, wo, w3: 2·T·h·(h·kv/a + h + f) FLOPs, split by tp) and every element-wise op again."""
    lay = Layout(recompute="selective")
    core = recomputed(lay, "core", MODEL, 8, 1, False)
    assert core.attention_core and not core.elementwise and core.forward_share == 0
    ops = recomputed(lay, "ops", MODEL, 8, 2, False)
    assert ops.elementwise and not ops.attention_core
    assert ops.matmul_flops == 2 * 8 * 4096 * (4096 * 8 / 32 + 4096 + 14336) / 2
    experts = recomputed(lay, "ops", replace(MODEL, n_experts=8, expert_ffn_dim=1024), 8, 1, True)
    assert experts.matmul_flops == 2 * 8 * 4096 * (4096 * 8 / 32 + 4096 + 1024)


def test_the_step_s_hardware_flops_count_what_runs_again():
    """Full recomputation adds a third of the model FLOPs (the forward again); the core
    policy adds the attention core's forward over every layer and token, counted as MFU
    counts it (the whole square)."""
    cost = CostModel(MODEL, 4096, 8, make_cluster("H100-SXM", 8),
                     framework=FRAMEWORKS["megatron"])
    base = Layout(dp_shard=8, zero_stage=1, micro_batch=1, microbatches=1)
    none = cost.evaluate(base)
    assert none.hardware_flops == none.model_flops
    full = cost.evaluate(replace(base, recompute="full"))
    assert full.hardware_flops == pytest.approx(full.model_flops * 4 / 3)
    selective = cost.evaluate(replace(base, recompute="selective"))
    core = 4 * 4096 * 4096 * 32 * 128  # one sequence's full square, one layer
    assert selective.hardware_flops - selective.model_flops == pytest.approx(8 * 32 * core)
