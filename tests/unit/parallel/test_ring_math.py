"""Single-process checks of the ring-attention math: zig-zag layout and block masks, online-softmax
merge, and the blockwise forward/backward against ``F.scaled_dot_product_attention(is_causal)``.

The ring is simulated in one process: rank j's step s sees the key/value block of rank
(j - s) mod r, exactly the order the distributed implementation uses. fp32 throughout; blockwise
attention differs from sdpa only in summation order, so the tolerance is rounding-level.
"""

import pytest
import torch

from loom.models.layers import sdpa_causal
from loom.parallel.context import CPLayout, check_layout, sequence_positions, shard_sequence
from loom.parallel.ring_attention import (Ring, attend_block, attend_block_backward,
                                          attend_block_backward_math, attend_block_math, block_kind,
                                          block_slices, merge_block, ring_attention,
                                          zigzag_positions)

RTOL, ATOL = 1e-5, 1e-6


def test_zigzag_positions_pair_chunks():
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="divisible by 2"):
        zigzag_positions(6, 0, 2)


@pytest.mark.parametrize("mode, size, u", [("ulysses", 4, 0), ("ring", 4, 0), ("hybrid", 4, 2),
                                           ("hybrid", 8, 0), ("ring", 1, 0)])
def test_sequence_positions_partition_the_sequence(mode, size, u):
    layout = CPLayout.from_mode(mode, size, u)
    S = 32
    held = torch.cat([sequence_positions(S, rank, layout) for rank in range(size)])
    assert sorted(held.tolist()) == list(range(S))
    if mode == "ulysses":  # contiguous: the all-to-all gathers the sequence in global order
        assert held.tolist() == list(range(S))
    tokens = torch.arange(2 * S).view(2, S)
    local, positions = shard_sequence(tokens, size - 1, layout)
    assert torch.equal(local, tokens[:, positions]) and local.shape == (2, S // size)


def test_hybrid_ulysses_groups_gather_a_zigzag_pair():
    layout = CPLayout.from_mode("hybrid", 4, 2)  # 2 Ulysses x 2 ring
    gathered = torch.cat([sequence_positions(16, rank, layout) for rank in (2, 3)])
    assert torch.equal(gathered, zigzag_positions(16, 1, 2))


def test_layout_rules():
    assert CPLayout.from_mode("hybrid", 4) == CPLayout(4, 2)
    assert CPLayout.from_mode("hybrid", 2) == CPLayout(2, 1)
    check_layout(CPLayout(4, 2), 16, 8, 2)
    with pytest.raises(ValueError, match="seq_len=12 must be divisible by 8"):
        check_layout(CPLayout(4, 1), 12, 8, 2)
    check_layout(CPLayout(4, 4), 12, 8, 4)  # Ulysses only needs cp | seq_len
    with pytest.raises(ValueError, match="n_kv_heads=2 must be divisible by the Ulysses degree 4"):
        check_layout(CPLayout(4, 4), 16, 8, 2)


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_block_kinds_match_the_causal_mask_of_global_positions(r):
    S = 8 * r
    for j in range(r):
        pos_q = zigzag_positions(S, j, r)
        for o in range(r):
            pos_k = zigzag_positions(S, o, r)
            want = pos_q[:, None] >= pos_k[None, :]
            rows, cols, causal = block_slices(block_kind(j, o), len(pos_q))
            got = torch.zeros_like(want)
            block = torch.ones_like(want[rows, cols])
            got[rows, cols] = block.tril() if causal else block
            assert torch.equal(got, want), (r, j, o)


def test_merge_of_two_key_halves_is_attention_over_all_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    full, full_lse = attend_block(q, k, v, causal=False)
    out = torch.zeros_like(full)
    lse = torch.full_like(full_lse, float("-inf"))
    for cols in (slice(0, 3), slice(3, 10)):
        out, lse = merge_block(out, lse, *attend_block(q, k[:, :, cols], v[:, :, cols], False))
    torch.testing.assert_close(out, full, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, full_lse, rtol=RTOL, atol=ATOL)


def _simulated_ring(q, k, v, dout, r):
    """Out and dQ/dK/dV of zig-zag ring attention over r simulated ranks, in global order."""
    S = q.shape[2]
    pos = [zigzag_positions(S, j, r) for j in range(r)]
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for j in range(r):
        qj, doj = q[:, :, pos[j]], dout[:, :, pos[j]]
        o = torch.zeros_like(qj)
        lse = torch.full(qj.shape[:3], float("-inf"))
        plan = []
        for step in range(r):
            src = (j - step) % r
            rows, cols, causal = block_slices(block_kind(j, src), len(pos[j]))
            plan.append((src, rows, cols, causal))
            kc, vc = k[:, :, pos[src]][:, :, cols], v[:, :, pos[src]][:, :, cols]
            o[:, :, rows], lse[:, :, rows] = merge_block(
                o[:, :, rows], lse[:, :, rows], *attend_block(qj[:, :, rows], kc, vc, causal))
        out[:, :, pos[j]] = o
        for src, rows, cols, causal in plan:
            kc, vc = k[:, :, pos[src]][:, :, cols], v[:, :, pos[src]][:, :, cols]
            dq_b, dk_b, dv_b = attend_block_backward(qj[:, :, rows], kc, vc, o[:, :, rows],
                                                     doj[:, :, rows], lse[:, :, rows], causal)
            dq[:, :, pos[j][rows]] += dq_b
            dk[:, :, pos[src][cols]] += dk_b
            dv[:, :, pos[src][cols]] += dv_b
    return out, dq, dk, dv


@pytest.mark.parametrize("r, n_kv", [(1, 4), (2, 2), (3, 1), (4, 4)])
def test_blockwise_ring_matches_sdpa_causal(r, n_kv):
    torch.manual_seed(r)
    B, N, S, Hd = 2, 4, 8 * r, 8
    q = torch.randn(B, N, S, Hd, requires_grad=True)
    k = torch.randn(B, n_kv, S, Hd, requires_grad=True)
    v = torch.randn(B, n_kv, S, Hd, requires_grad=True)
    dout = torch.randn(B, N, S, Hd)
    ref = sdpa_causal(q, k, v)
    ref.backward(dout)
    with torch.no_grad():
        out, dq, dk, dv = _simulated_ring(q, k, v, dout, r)
    for name, got, want in (("out", out, ref), ("dq", dq, q.grad), ("dk", dk, k.grad),
                            ("dv", dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_ring_of_one_is_causal_attention_and_keeps_fp32_statistics_under_autocast():
    # A ring of one rank runs the autograd Function without any message: forward and backward
    # must equal sdpa's; under bf16 autocast the softmax statistics must stay fp32 (autocast off
    # inside), so the result is as close to the fp32 reference as bf16 inputs allow.
    torch.manual_seed(3)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 4, 16, 8)
    ring = Ring(group=None, ranks=(0,), index=0)
    got = ring_attention(q, k, v, ring)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want = sdpa_causal(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for g, w in zip((got, *grads), (want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ring_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), ring)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("causal, sq, sk", [(True, 12, 12), (False, 6, 12), (False, 12, 6)])
def test_flash_kernel_path_equals_the_plain_math(causal, sq, sk):
    # The CPU path uses torch's flash kernels (they expose the log-sum-exp); the plain math is
    # the reference and the path elsewhere. Same results up to rounding, GQA included.
    torch.manual_seed(5)
    q, dout = torch.randn(2, 4, sq, 8), torch.randn(2, 4, sq, 8)
    k, v = torch.randn(2, 2, sk, 8), torch.randn(2, 2, sk, 8)
    out, lse = attend_block(q, k, v, causal)
    ref_out, ref_lse = attend_block_math(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, ref_lse, rtol=RTOL, atol=ATOL)
    got = attend_block_backward(q, k, v, out, dout, lse, causal)
    want = attend_block_backward_math(q, k, v, out, dout, lse, causal)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("causal, masked", [(True, False), (False, False), (False, True)])
def test_math_blocks_taken_in_query_tiles_equal_the_whole_block(causal, masked):
    """The plain-torch path bounds a block's score memory by taking query rows in tiles: with a
    budget of a few rows, output, log-sum-exp and every gradient equal the untiled block's."""
    g = torch.Generator().manual_seed(3)
    B, N, K, S, Hd = 2, 4, 2, 24, 8
    q, dout = (torch.randn(B, N, S, Hd, generator=g) for _ in range(2))
    k, v = (torch.randn(B, K, S, Hd, generator=g) for _ in range(2))
    allowed = torch.rand(B, S, S, generator=g) > 0.3 if masked else None
    row_bytes = 4 * B * N * S  # one query row's fp32 scores against the block's keys
    whole = attend_block_math(q, k, v, causal, allowed)
    tiled = attend_block_math(q, k, v, causal, allowed, tile_bytes=5 * row_bytes)  # 5 + ... + 4
    for got, want in zip(tiled, whole):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    grads_whole = attend_block_backward_math(q, k, v, *whole[:1], dout, whole[1], causal, allowed)
    grads_tiled = attend_block_backward_math(q, k, v, *whole[:1], dout, whole[1], causal, allowed,
                                             tile_bytes=5 * row_bytes)
    for name, got, want in zip(("dq", "dk", "dv"), grads_tiled, grads_whole):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
