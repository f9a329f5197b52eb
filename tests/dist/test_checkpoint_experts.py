"""Checkpoints of expert-parallel MoE models: each ep rank saves its experts as a slice of the
global ``[E, ...]`` tensors (global names, full shapes), so an ep2 checkpoint loads under one
process, plain data parallelism and ep4 with bit-identical weights and optimizer state, and an
ep2 run resumes bit-exactly."""

from __future__ import annotations

import pytest

from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_checkpoint_resume import (assert_equal_states, check_reshard, check_resume,
                                               save_after, state_after_load)

STEPS = 4
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "tiny-moe", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0}

LAYOUTS = {  # name -> (world size, parallel degrees); tiny-moe has 4 experts
    "single": (1, {}),
    "dp2": (2, {"dp_replicate": 2}),
    "ep2": (2, {"ep": 2, "dp_replicate": 1}),
    "ep4": (4, {"ep": 4, "dp_replicate": 1}),
    "dp2-ep2": (4, {"ep": 2, "dp_replicate": 2}),
    "ep2-tp2": (4, {"ep": 2, "tp": 2, "dp_replicate": 1}),  # expert-TP inside each ep slice
    "tp2": (2, {"tp": 2}),
    "pp2-ep2": (4, {"pp": 2, "ep": 2, "dp_replicate": 1, "schedule": "1f1b"}),
}


def config_for(layout: str) -> dict:
    world, parallel = LAYOUTS[layout]
    return layout_config(BASE, world, **parallel)


@pytest.fixture(scope="module")
def ep2_saved(dist, small_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ep2")
    return dist.run(2, save_after, config_for("ep2"), small_data_dir, str(root), 2)[0]


@pytest.mark.parametrize("target", ["single", "dp2", "ep4", "dp2-ep2"])
def test_an_ep2_checkpoint_loads_bit_identically(dist, small_data_dir, ep2_saved, target):
    path, saved = ep2_saved
    step, loaded = dist.run(LAYOUTS[target][0], state_after_load, config_for(target),
                            small_data_dir, path)[0]
    assert step == 2
    assert any("experts.w1" in name for name in saved)
    assert_equal_states(loaded, saved, f"ep2 -> {target}")


@pytest.mark.parametrize("source, target", matrix(
    [("ep4", "ep2"), ("dp2-ep2", "ep4"), ("single", "ep2"), ("ep2-tp2", "single"),
     ("ep4", "ep2-tp2"), ("tp2", "ep2"), ("pp2-ep2", "single"), ("ep4", "pp2-ep2")],
    ci=[("ep2-tp2", "single"), ("ep4", "pp2-ep2")]))  # ep, tp and pp on one side each
def test_other_expert_layouts_reshard(dist, small_data_dir, tmp_path, source, target):
    check_reshard(dist, small_data_dir, tmp_path, (LAYOUTS[source][0], config_for(source)),
                  (LAYOUTS[target][0], config_for(target)), f"{source} -> {target}")


@pytest.mark.parametrize("layout", matrix(["ep2", "dp2-ep2", "ep2-tp2", "pp2-ep2"],
                                          ci=["ep2", "pp2-ep2"]))  # ep2 x tp2: reshards
def test_an_expert_parallel_run_resumes_bit_exact(dist, small_data_dir, tmp_path, layout):
    check_resume(dist, small_data_dir, tmp_path, LAYOUTS[layout][0], config_for(layout), layout,
                 steps=STEPS)
