"""Mixture of experts through the real Trainer: the balancing loss joins the objective, and expert
parallelism (alone and folded with data parallelism) gives one process's loss and gradients.

The technique-level tests are in test_expert_parallel.py; these check the composition the trainer
runs: parallelize()'s expert step, the dense-only data-parallel reducer, the expert gradient rule
(sum outside ep, divide by dp x ep), ep-aware clipping and gathered expert gradients.
"""

import pytest

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "tiny-moe", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "optim.lr": 1e-3, "train.grad_clip": 1.0}
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6  # as in test_data_parallel.py
RTOL, ATOL = 1e-4, 1e-5

LAYOUTS = {"ep2": (2, {"ep": 2, "dp_replicate": 1}), "ep4": (4, {"ep": 4, "dp_replicate": 1}),
           "dp2-ep2": (4, {"ep": 2, "dp_replicate": 2})}
ROUTING = {"dropless": {}, "capacity-1.0": {"model.capacity_factor": 1.0}}


@pytest.fixture(scope="module")
def references(dist, small_data_dir):
    return {name: dist.run(1, record_training, layout_config({**BASE, **extra}, 1),
                           small_data_dir, STEPS)[0] for name, extra in ROUTING.items()}


@pytest.mark.parametrize("routing", list(ROUTING))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_trainer_matches_one_process(dist, small_data_dir, references, layout,
                                                     routing):
    world, parallel = LAYOUTS[layout]
    config = layout_config({**BASE, **ROUTING[routing]}, world, **parallel)
    for rank, result in enumerate(dist.run(world, record_training, config, small_data_dir,
                                           STEPS)):
        label = f"{layout} {routing} rank {rank}"
        assert_parity(references[routing], result, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                      label=label, steps=range(1))
        assert_parity(references[routing], result, rtol=RTOL, atol=ATOL, label=label)


def test_the_moe_model_learns(references):
    losses = references["dropless"]["loss"]
    assert losses[-1] < losses[0]
