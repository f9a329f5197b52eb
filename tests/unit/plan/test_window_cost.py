"""The planner prices a sliding window (Mistral's ``model.sliding_window``) by the pairs inside it.

A causal query i of an S-token sequence attends to keys i-W+1 .. i under a window W: the core's
work is the visible pairs ``W·S - W(W-1)/2``, not the causal half-square ``S²/2``. Flash kernels
skip the blocks past the window, and so does Loom's ring (``tests/dist/test_context_window.py``).
A kernel that stores the scores computes the whole square with or without it. The expected
values are counted pair by pair here, never taken from the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest

from loom.formulas.flops import attended_keys
from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS

MISTRAL_LIKE = TransformerArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=1024,
                               vocab_size=1024, max_seq_len=8192)
GPU = Gpu("unit", peak_flops=1e15, memory_bytes=80 * 2**30, hbm_bandwidth=3e12,
          matmul_efficiency=0.7, matmul_knee=64)
LINK = Link("link", 100 * GB, 1e-6, efficiency=1.0)


def pairs(seq: int, window: int) -> int:
    """Visible (query, key) pairs, counted one by one."""
    return sum(1 for i in range(seq) for j in range(i + 1) if not window or i - j < window)


@pytest.mark.parametrize("seq, window", [(8, 3), (8, 1), (64, 16), (100, 37), (64, 64),
                                          (64, 200)])
def test_attended_keys_are_the_visible_pairs_per_query(seq, window):
    expected = pairs(seq, window) / seq if window < seq else seq / 2
    assert attended_keys(seq, window) == pytest.approx(expected, rel=1e-12)
    assert attended_keys(seq) == seq / 2  # no window: the causal half-square's convention


def _model(window: int, kernel: str = "flash2") -> CostModel:
    args = dataclasses.replace(MISTRAL_LIKE, sliding_window=window)
    framework = dataclasses.replace(FRAMEWORKS["loom"], attention_kernel=kernel)
    return CostModel(args, seq_len=4096, global_batch=8, cluster=Cluster(GPU, 1, 8, LINK, LINK),
                     framework=framework)


def test_the_core_shrinks_to_the_window_and_nothing_else_changes():
    full, windowed = _model(0), _model(512)
    matmuls, core = full.layer_flops(4096, 1, False)
    w_matmuls, w_core = windowed.layer_flops(4096, 1, False)
    assert w_matmuls == matmuls
    assert w_core / core == pytest.approx((512 * 4096 - 512 * 511 / 2) / (4096 ** 2 / 2),
                                          rel=1e-12)
    # a window as long as the sequence is no window: bit for bit
    assert _model(4096).layer_flops(4096, 2, False) == full.layer_flops(4096, 2, False)
    assert _model(9999).evaluate(Layout()).pipeline == full.evaluate(Layout()).pipeline


def test_a_windowed_layout_steps_faster_on_a_flash_kernel_only():
    flash = _model(0).evaluate(Layout()).pipeline, _model(512).evaluate(Layout()).pipeline
    assert flash[1] < flash[0]
    # a kernel that stores the scores (DeepSpeed's fused softmax, an unfused core) computes
    # and moves the whole square, window or not
    for kernel in ("fused", "unfused"):
        square = _model(0, kernel).evaluate(Layout()), _model(512, kernel).evaluate(Layout())
        assert square[1].pipeline == pytest.approx(square[0].pipeline, rel=1e-12)
        assert square[0].pipeline > flash[0]
