"""All-gather context parallelism's transient buffers in the memory estimator and the planner.

``loom.parallel.allgather_attention`` gathers every cp rank's stacked keys and values per layer
(forward and backward): the bytes are pinned here to the shape of the buffer it allocates, the
estimator adds them at the instants where a layer's attention can run (never under the ring),
and the planner's Loom profile prices the same bytes, component by component.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loom.config import load_config, resolve
from loom.formulas.memory import allgather_attention_bytes
from loom.layout import Layout
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_model import CostModel
from loom.train.memory import attention_transient_bytes, estimate_memory, memory_instants

SMALL = {"model.preset": "debug", "data.seq_len": "32", "train.micro_batch_size": "2",
         "train.global_batch_size": "8", "train.dtype": "bf16"}


UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
LINK = Link("link", 100 * GB, 1e-6, efficiency=1.0)


def config(world: int, **overrides: str):
    return resolve(load_config(None, {**SMALL, **overrides}), world)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.empty(shape, dtype=dtype, device="meta").nbytes


@pytest.mark.parametrize("cp, b, k, s, hd, dtype", [
    (2, 1, 2, 2048, 64, torch.bfloat16), (4, 2, 1, 512, 128, torch.bfloat16),
    (8, 1, 8, 128, 16, torch.float32)])
def test_bytes_are_the_gathered_buffers_shape(cp, b, k, s, hd, dtype):
    """The buffer ``_gather`` allocates: every cp rank's stacked keys and values, each the
    ``[2, B, K, S, Hd]`` pair of the compute dtype that the attention stacks."""
    pair = torch.stack([torch.empty(b, k, s, hd, dtype=dtype, device="meta")] * 2)
    gathered = torch.empty((cp * pair.shape[0], *pair.shape[1:]), dtype=dtype, device="meta")
    got = allgather_attention_bytes(s=s, b=b, kv_heads=k, head_dim=hd, cp=cp,
                                    e=pair.element_size())
    assert got == gathered.nbytes == cp * pair.nbytes


def test_estimator_adds_them_under_allgather_only():
    """The same layout under the ring and under all-gather differs by the formula's bytes at
    every instant where an attention can run (in ``transient``), and not at the loss's
    backward or the optimizer step."""
    ring = config(2, **{"parallel.cp": "2", "parallel.cp_mode": "ring"})
    gather = config(2, **{"parallel.cp": "2", "parallel.cp_mode": "allgather"})
    m = gather.model
    expected = allgather_attention_bytes(s=32 // 2, b=2, kv_heads=m.n_kv_heads,
                                         head_dim=m.head_dim, cp=2, e=2)
    # a rank's pair 2·B·K·S·Hd = 2·2·2·16·16 = 2048 elements; two ranks' of them in bf16
    assert attention_transient_bytes(gather) == expected == 8192
    assert attention_transient_bytes(ring) == 0.0
    pairs = list(zip(memory_instants(ring), memory_instants(gather), strict=True))
    added = 0
    for r, g in pairs:
        assert (g.parameters, g.gradients, g.optimizer, g.activations) == \
            (r.parameters, r.gradients, r.optimizer, r.activations)
        loss = any("loss's backward" in note for note in r.notes)
        if r.activations and not loss:
            assert g.transient == r.transient + expected
            assert any("all-gather CP" in note for note in g.notes)
            added += 1
        else:
            assert g.transient == r.transient
    assert added >= 2  # the forward and the backward at least


def test_tensor_parallelism_splits_the_key_value_heads():
    """Under tp each rank gathers its K/tp heads only."""
    one = config(2, **{"parallel.cp": "2", "parallel.cp_mode": "allgather"})
    two = config(4, **{"parallel.cp": "2", "parallel.cp_mode": "allgather",
                       "parallel.tp": "2"})
    assert attention_transient_bytes(two) == attention_transient_bytes(one) / 2


@pytest.mark.parametrize("parallel, layout", [
    ({"parallel.cp": "2"}, Layout(cp=2, micro_batch=2, microbatches=4)),
    ({"parallel.cp": "4", "train.global_batch_size": "2", "train.micro_batch_size": "1"},
     Layout(cp=4, micro_batch=1, microbatches=2)),
    ({"parallel.cp": "2", "parallel.tp": "2"},
     Layout(cp=2, tp=2, micro_batch=2, microbatches=4)),
    ({"parallel.dp_shard": "2", "parallel.dp_replicate": "1", "parallel.cp": "2",
      "parallel.zero_stage": "3", "train.global_batch_size": "4"},
     Layout(dp_shard=2, cp=2, zero_stage=3, micro_batch=2, microbatches=1)),
])
def test_planner_prices_them_as_the_estimator(parallel, layout):
    """The planner's Loom profile equals the estimator component by component under
    ``cp_mode = allgather``, whose peak is the ring's or higher by at most the gathered
    buffer (the cp 4 layout peaks with it, the others at the loss's backward, the optimizer
    step or ZeRO-3's reduction)."""
    # every head its own key/value head of 64: at cp 4 the gathered buffer outweighs the
    # loss's backward's, so the peak holds it
    config_ = config(layout.world, **{**parallel, "parallel.cp_mode": "allgather",
                                      "model.n_kv_heads": "4", "model.dim": "256"})
    lay = replace(layout, cp_mode="allgather")
    expected = estimate_memory(config_)
    model = CostModel(config_.model, seq_len=32, global_batch=config_.train.global_batch_size,
                      cluster=Cluster(UNIT, layout.world, 8, LINK, LINK))
    got = model.memory(lay)
    for name in ("parameters", "gradients", "optimizer", "activations", "transient"):
        assert got[name] == pytest.approx(getattr(expected, name), rel=1e-9), name
    assert attention_transient_bytes(config_) > 0
    ring = model.memory(replace(lay, cp_mode="ring"))
    assert sum(ring.values()) <= sum(got.values()) <= sum(ring.values()) + \
        attention_transient_bytes(config_)
    if any("all-gather CP" in note for note in expected.notes):  # the peak holds it
        assert sum(got.values()) > sum(ring.values())
        assert got["transient"] == expected.transient >= attention_transient_bytes(config_)
