"""MoE models in a pipeline (pp > 1), alone and with expert parallelism inside the stages.

Only the last stage holds the loss, so each MoE layer adds its balancing loss's gradient in
backward (``MoEFeedForward.aux_loss_backward_scale`` = aux_loss_coef / microbatches, set by the
trainer), the role of Megatron's ``MoEAuxLossAutoScaler``. Parity through the real ``Trainer``
with the base config, tolerances and comparison of ``test_expert_tp.py``: the ``tiny-moe`` model
(layer 0 dense, layers 1-3 MoE, so both stages hold MoE layers), 3 AdamW steps in fp32 with
clipping, on one process and on pp2 (1F1B, and ZB-V whose backward is split into I and W), pp2 x
ep2 (1F1B, dropless and with capacity drops), pp2 x ep2 with ZB-V, and pp2 x tp2 with 1F1B
(expert-TP = TP inside the stages; without and with sequence parallelism, the latter also with
capacity drops), and pp2 x ep2 x tp2 on 8 ranks. Loss, gradient norm, the logged load-balancing
loss (summed over the stages) and every parameter's full gradient must match; a run whose stages dropped their balancing-loss
gradient differs in the routers' gradients (checked: the pp2 1F1B case fails without it).
"""

from __future__ import annotations

import pytest

from tests.conftest import matrix
from tests.dist.test_expert_tp import ROUTING, assert_layout_matches, references  # noqa: F401

LAYOUTS = {  # name: (world, degrees, extra overrides)
    "pp2-1f1b": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "pp2-zbv": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "zbv"}),
    "pp2-ep2-1f1b": (4, {"pp": 2, "ep": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "pp2-ep2-zbv": (4, {"pp": 2, "ep": 2, "dp_replicate": 1}, {"parallel.schedule": "zbv"}),
    "pp2-tp2-1f1b": (4, {"pp": 2, "tp": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "pp2-tp2-sp-1f1b": (4, {"pp": 2, "tp": 2, "dp_replicate": 1},
                        {"parallel.schedule": "1f1b", "parallel.sequence_parallel": True}),
    # the clipping norm of ep x tp needs the TP record passed explicitly (stages never had it)
    "pp2-ep2-tp2-1f1b": (8, {"pp": 2, "ep": 2, "tp": 2, "dp_replicate": 1},
                         {"parallel.schedule": "1f1b"}),
}
CASES = [(layout, "dropless") for layout in LAYOUTS] + [("pp2-ep2-1f1b", "capacity-1.0"),
                                                         ("pp2-tp2-sp-1f1b", "capacity-1.0")]


@pytest.mark.parametrize("layout, routing", matrix(CASES, ci=[
    ("pp2-zbv", "dropless"), ("pp2-ep2-1f1b", "dropless"), ("pp2-tp2-sp-1f1b", "dropless"),
    ("pp2-ep2-1f1b", "capacity-1.0")]),
    ids=[f"{a}-{b}" for a, b in CASES])
def test_moe_pipeline_trainer_matches_one_process(dist, small_data_dir, references, layout,
                                                  routing):
    world, degrees, extra = LAYOUTS[layout]
    assert_layout_matches(dist, small_data_dir, references(routing), world, degrees,
                          {**ROUTING[routing], **extra}, f"{layout} {routing}")
