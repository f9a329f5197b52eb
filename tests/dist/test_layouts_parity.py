"""The parity matrix through the real Trainer: tensor, sequence, vocabulary and context
parallelism, alone and combined with data parallelism, give one process's loss and gradients.

Same model (debug preset with 4 query and 4 key/value heads so tp=4 fits), seed and data; 2
optimizer steps, fp32. The technique-level tests (tests/dist/test_tensor_parallel.py,
test_context_parallel.py) check each module in isolation; these check the composition the trainer
actually runs: parallelize() order, loss averaging over dp x cp, gradient reduction over dp x cp
of local (DTensor) gradients, TP-aware clipping and full-gradient gathering.
"""

import pytest

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_kv_heads": 4,
        "train.steps": STEPS, "train.global_batch_size": 8, "train.micro_batch_size": 2,
        "optim.warmup_steps": 1, "optim.lr": 1e-3, "train.grad_clip": 1.0}
# As in test_data_parallel.py: step 1 differs only by summation order; later steps inherit Adam's
# amplification of rounding-level gradient elements.
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5

LAYOUTS = {
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "tp2-no-vocab-parallel": (2, {"tp": 2, "vocab_parallel": False}),
    "tp4-sp": (4, {"tp": 4, "sequence_parallel": True}),
    "cp2-ring": (2, {"cp": 2, "cp_mode": "ring"}),
    "cp2-ulysses": (2, {"cp": 2, "cp_mode": "ulysses"}),
    "cp4-hybrid": (4, {"cp": 4, "cp_mode": "hybrid"}),
    "cp2-allgather": (2, {"cp": 2, "cp_mode": "allgather"}),
    "dp2-tp2": (4, {"dp_replicate": 2, "tp": 2}),
    "dp2-cp2": (4, {"dp_replicate": 2, "cp": 2}),
    "tp2-cp2-sp": (4, {"tp": 2, "cp": 2, "sequence_parallel": True}),
    "dp2-tp2-cp2": (8, {"dp_replicate": 2, "tp": 2, "cp": 2, "sequence_parallel": True}),
}


@pytest.fixture(scope="module")
def reference(dist, small_data_dir):
    return dist.run(1, record_training, layout_config(BASE, 1), small_data_dir, STEPS)[0]


# matrix: tp4-SP (tp2-SP runs) and dp2 x tp2 x cp2 (tp2 x cp2 and dp2 x tp2 run)
@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[name for name in LAYOUTS
                                                       if name not in ("tp4-sp", "dp2-tp2-cp2")]))
def test_layout_matches_one_process(dist, small_data_dir, reference, layout):
    world, parallel = LAYOUTS[layout]
    config = layout_config(BASE, world, **parallel)
    results = dist.run(world, record_training, config, small_data_dir, STEPS)
    for rank, result in enumerate(results):
        label = f"{layout} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)


# Tensor and context parallelism inside pipeline stages (8 ranks: the combinations).
PIPELINE_LAYOUTS = {
    "pp2-tp2": (4, {"pp": 2, "tp": 2, "schedule": "1f1b"}),
    "pp2-tp2-zbv": (4, {"pp": 2, "tp": 2, "schedule": "zbv"}),
    "pp2-tp2-sp": (4, {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "1f1b"}),
    "pp2-cp2-ring": (4, {"pp": 2, "cp": 2, "schedule": "interleaved_1f1b", "chunks": 2}),
    "pp2-tp2-dp2": (8, {"pp": 2, "tp": 2, "dp_replicate": 2, "schedule": "1f1b"}),
    "pp2-cp2-tp2": (8, {"pp": 2, "cp": 2, "tp": 2, "sequence_parallel": True,
                        "schedule": "interleaved_1f1b", "chunks": 2}),
    "pp2-cp2-tp2-zbh1": (8, {"pp": 2, "cp": 2, "tp": 2, "schedule": "zb_h1"}),
}


@pytest.mark.parametrize("layout", matrix(PIPELINE_LAYOUTS, ci=[  # pp2-tp2: inside the others
    name for name in PIPELINE_LAYOUTS if name not in ("pp2-cp2-tp2-zbh1", "pp2-tp2",
                                                      "pp2-cp2-tp2")]))
def test_parallelism_inside_pipeline_stages_matches_one_process(dist, small_data_dir, reference,
                                                               layout):
    world, parallel = PIPELINE_LAYOUTS[layout]
    config = layout_config(BASE, world, **parallel)
    for rank, result in enumerate(dist.run(world, record_training, config, small_data_dir, STEPS)):
        label = f"{layout} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)
