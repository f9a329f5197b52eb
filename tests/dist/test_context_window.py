"""Sliding-window attention (Mistral's ``model.sliding_window``) under every context-parallel mode
is one process's windowed attention, split.

* The blocks: a ring step's tiles under a window (``context_documents.document_tiles`` with
  ``window``; ``window_keys`` for concatenated rows) give the output, log-sum-exp and gradients
  of the dense block masked by document, causality and the window, on cp-sharded documents of
  every shape and windows from 1 token to longer than the row; a block wholly past the window
  is skipped, and a window as long as the sequence leaves the plain causal ring.
* The core (output, dQ, dK, dV) on concatenated rows under ring (cp = 2, 4), hybrid (u = 2,
  r = 2) and all-gather (cp = 2, 4) with windows shorter than a zig-zag chunk, equal to it and
  longer, equals ``sdpa_causal`` with the window on the whole row (the documents' core with a
  window: ``tests/dist/test_context_documents.py``).
* The ``Trainer`` (2 AdamW steps, loss, gradient norm and every gradient) with a window under
  cp equals one process with the same window: concatenated rows under ring, hybrid and
  all-gather; varlen under ring; packed rows under all-gather; Zeppelin's placement (varlen,
  sub-rings and whole documents) under cp = 2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.models.layers import sdpa_causal
from loom.parallel.context import (CPGroups, CPLayout, ContextParallelAttention, new_cp_groups,
                                   sequence_positions)
from loom.parallel.context_documents import (block_backward, block_forward,
                                             document_shard_indices, document_tiles, window_keys)
from loom.parallel.ring_attention import zigzag_positions
from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.data_fixtures import prepared_documents

RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
CPU = torch.device("cpu")


# -- the blocks ---------------------------------------------------------------------------------
def _dense(ids_q, pos_q, ids_k, pos_k, window):
    """The block's mask written out: same real document, causal, inside the window."""
    distance = pos_q[:, None] - pos_k[None, :]
    allowed = (ids_q[:, None] == ids_k[None, :]) & (ids_q >= 0)[:, None] & (distance >= 0)
    if window:
        allowed &= distance < window
    return torch.from_numpy(allowed)[None]


def _assert_block_equal(tiles, dense, gen):
    S_q, S_k = dense.shape[1:]
    q = torch.randn(2, 4, S_q, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, S_k, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, S_k, 8, generator=gen, dtype=torch.float64)
    out_d, lse_d = block_forward(q, k, v, dense)
    if tiles is None:  # skipped: nothing visible at all
        assert not dense.any()
        return
    out_t, lse_t = block_forward(q, k, v, tiles)
    torch.testing.assert_close(out_t, out_d)
    torch.testing.assert_close(lse_t, lse_d)
    seen = torch.isfinite(lse_d[0, 0])
    dout = torch.randn(out_d.shape, generator=gen, dtype=torch.float64) * seen[:, None]
    lse_fin = lse_d.masked_fill(~seen, 0.0)
    for a, b in zip(block_backward(q, k, v, out_d, dout, lse_fin, tiles),
                    block_backward(q, k, v, out_d, dout, lse_fin, dense)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("ring", [2, 3, 4])
@pytest.mark.parametrize("window", [1, 3, 7, 20, 200])
def test_windowed_document_tiles_equal_the_dense_windowed_block(ring, window):
    """cp-sharded documents (a long one cut over the ring, short ones, padding) against every
    ring step's keys: each step's tiles are its dense block under the window."""
    gen = torch.Generator().manual_seed(ring * 100 + window)
    lengths = [150, 3, 1, 40, 9, 60]
    ids = np.concatenate([np.full(n, d) for d, n in enumerate(lengths)] + [np.full(5, -1)])
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(5, dtype=np.int64)])
    shards = [document_shard_indices(torch.from_numpy(ids)[None], ring, 1, g)[0].numpy()
              for g in range(ring)]
    def side(g):
        index = shards[g]
        real = index >= 0
        return (np.where(real, ids[index.clip(0)], -1), np.where(real, pos[index.clip(0)], 0))
    for me in range(ring):
        ids_q, pos_q = side(me)
        for step in range(ring):
            ids_k, pos_k = side((me - step) % ring)
            for tile_tokens in (4, 128):
                tiles = document_tiles(ids_q, pos_q, ids_k, pos_k, CPU, tile_tokens,
                                       own_keys=step == 0, window=window)
                _assert_block_equal(tiles or None, _dense(ids_q, pos_q, ids_k, pos_k, window),
                                    gen)


@pytest.mark.parametrize("seq_len, ring, window", [(32, 2, 5), (32, 2, 8), (64, 4, 4),
                                                   (64, 4, 12), (96, 3, 30)])
def test_concatenated_rows_blocks_under_a_window_are_the_dense_block(seq_len, ring, window):
    gen = torch.Generator().manual_seed(seq_len + window)
    for me in range(ring):
        keys = window_keys(seq_len, ring, me, window, CPU)
        pos_q = zigzag_positions(seq_len, me, ring).numpy()
        for step, tiles in enumerate(keys.block_masks):
            pos_k = zigzag_positions(seq_len, (me - step) % ring, ring).numpy()
            zeros_q, zeros_k = np.zeros(len(pos_q), dtype=np.int64), np.zeros(len(pos_k),
                                                                              dtype=np.int64)
            _assert_block_equal(tiles, _dense(zeros_q, pos_q, zeros_k, pos_k, window), gen)


def test_a_block_past_the_window_is_skipped_and_one_inside_it_keeps_the_kernel():
    # 1024 tokens over a ring of 4, chunks of 128: ring rank 3 holds positions 384-511 and
    # 512-639; owners 2, 1, 0 (steps 1-3) hold 256-383 and 640-767, 128-255 and 768-895,
    # 0-127 and 896-1023
    narrow = window_keys(1024, 4, 3, 100, CPU).block_masks
    assert narrow[2] is None and narrow[3] is None  # every key >= 129 positions back
    assert [t.kernel for t in narrow[0]] == ["masked"]  # the window cuts the diagonal
    assert [t.kernel for t in narrow[1]] == ["masked"]  # 384-511 x 256-383: its edge
    wide = window_keys(1024, 4, 3, 700, CPU).block_masks  # every past pair < 700 apart
    assert [t.kernel for t in wide[0]] == ["causal"]
    for step in (1, 2, 3):  # its queries (one run: 384-639) against the owner's past chunk
        assert [t.kernel for t in wide[step]] == ["full"]
    # ring rank 0's own block (0-127 and 896-1023) under a window of 100: each chunk against
    # itself (masked at the window's edge), nothing across them, not one 256 x 256 tile
    own = window_keys(1024, 4, 0, 100, CPU).block_masks[0]
    assert [(t.kernel, len(t.q_index), len(t.k_index)) for t in own] == [("masked", 128, 128)] * 2
    # ring rank 0 (0-127, 896-1023) against owner 1 (128-255, 768-895) under a window of 400:
    # 896-1023 x 768-895 is inside it, 896-1023 x 128-255 wholly past it: one full tile
    assert [t.kernel for t in window_keys(1024, 4, 0, 400, CPU).block_masks[3]] == ["full"]


def test_a_window_as_long_as_the_sequence_runs_the_plain_causal_ring():
    groups = CPGroups(CPLayout(2, 1), cp_rank=0, cp=None, ulysses=None, ring=None,
                      ring_ranks=(0, 1))
    core = ContextParallelAttention(groups, window=32)
    assert core._windowed_rows(16, CPU) is None  # 2 x 16 tokens: the window spans the row
    assert core._windowed_rows(32, CPU) is not None


# -- the core on concatenated rows --------------------------------------------------------------
BATCH, SEQ = 2, 64


def _attention_inputs():
    g = torch.Generator().manual_seed(7)
    shape_q, shape_kv = (BATCH, 8, SEQ, 16), (BATCH, 4, SEQ, 16)
    return (torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g),
            torch.randn(shape_kv, generator=g), torch.randn(shape_q, generator=g))


def windowed_core(ctx, mode, cp, ulysses, window):
    """Output and dQ/dK/dV of the cp core with a window on this rank's shard."""
    layout = CPLayout.from_mode(mode, cp, ulysses)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    q, k, v, dout = _attention_inputs()
    positions = sequence_positions(SEQ, groups.cp_rank, layout)
    local = [t[:, :, positions].detach().requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(groups, window=window)(*local)
    out.backward(dout[:, :, positions])
    return positions, out.detach(), *(t.grad for t in local)


CORE_CASES = {  # chunks of SEQ / 2r tokens: 16 at cp = 2, 8 at r = 4 and in hybrid's r = 2 ...
    "ring-cp2-w5": ("ring", 2, 0, 5),  # inside a chunk
    "ring-cp2-w16": ("ring", 2, 0, 16),  # one chunk
    "ring-cp4-w12": ("ring", 4, 0, 12),  # between one and two chunks
    "ring-cp4-w3": ("ring", 4, 0, 3),
    "hybrid-cp4-w20": ("hybrid", 4, 2, 20),
    "allgather-cp4-w5": ("allgather", 4, 0, 5),
    "allgather-cp2-w40": ("allgather", 2, 0, 40),
}


@pytest.mark.parametrize("case", matrix(CORE_CASES, ci=["ring-cp2-w5", "ring-cp4-w12",
                                                         "hybrid-cp4-w20", "allgather-cp4-w5"]))
def test_the_core_applies_the_window_in_every_mode(dist, case):
    mode, cp, ulysses, window = CORE_CASES[case]
    q, k, v, dout = (t.requires_grad_() for t in _attention_inputs())
    want = sdpa_causal(q, k, v, window=window)
    want.backward(dout.detach())
    assert (want - sdpa_causal(q, k, v)).abs().max() > 1e-2  # the window matters here
    got = [torch.zeros_like(t) for t in (want, q, k, v)]
    for positions, *local in dist.run(cp, windowed_core, mode, cp, ulysses, window):
        for full, part in zip(got, local):
            full[:, :, positions] = part
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, w, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m: f"{case} {name}: {m}")


# -- the trainer --------------------------------------------------------------------------------
STEPS, WINDOW = 2, 6
ROWS = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_kv_heads": 4,
        "model.sliding_window": WINDOW, "train.steps": STEPS, "train.global_batch_size": 4,
        "train.micro_batch_size": 2, "optim.warmup_steps": 1, "optim.lr": 1e-3,
        "train.grad_clip": 1.0}
SEQ_LEN, BUDGET = 32, 48  # documents: split length, tokens per varlen microbatch
TRAINER_LAYOUTS = {  # name: (world, degrees, data: rows | varlen | pack, other overrides)
    "rows-ring-cp2": (2, {"cp": 2, "cp_mode": "ring"}, "rows", {}),
    "rows-hybrid-cp4": (4, {"cp": 4, "cp_mode": "hybrid"}, "rows", {}),
    "rows-allgather-cp2": (2, {"cp": 2, "cp_mode": "allgather"}, "rows", {}),
    "varlen-ring-cp2": (2, {"cp": 2, "cp_mode": "ring"}, "varlen", {}),
    "pack-allgather-cp2": (2, {"cp": 2, "cp_mode": "allgather"}, "pack", {}),
    "varlen-zeppelin-cp2": (2, {"cp": 2, "cp_mode": "ring"}, "varlen",
                            {"data.balance": "zeppelin"}),
}


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> tuple[str, dict]:
    data_dir, overrides = prepared_documents(tmp_path_factory, "window_docs", SEQ_LEN, count=300,
                                             seed=29)
    overrides.update({"model.preset": "tiny", "model.n_layers": 2, "train.steps": STEPS,
                      "model.sliding_window": WINDOW})
    return data_dir, overrides


def _data(kind: str, documents, small_data_dir) -> tuple[str, dict]:
    if kind == "rows":
        return small_data_dir, ROWS
    data_dir, base = documents
    if kind == "varlen":
        return data_dir, {**base, "data.packing": "varlen", "data.tokens_per_microbatch": BUDGET,
                          "train.global_batch_tokens": 4 * BUDGET}
    return data_dir, {**base, "data.packing": "pack", "train.global_batch_size": 4,
                      "train.micro_batch_size": 2}


_references: dict[str, dict] = {}


@pytest.mark.parametrize("layout", matrix(TRAINER_LAYOUTS, ci=[
    "rows-ring-cp2", "rows-allgather-cp2", "varlen-ring-cp2", "varlen-zeppelin-cp2"]))
def test_the_trainer_with_a_window_under_cp_matches_one_process(dist, documents, small_data_dir,
                                                                layout):
    world, degrees, kind, extra = TRAINER_LAYOUTS[layout]
    data_dir, base = _data(kind, documents, small_data_dir)
    # one process with the same window (under zeppelin: tokens' deal, the same bins)
    reference_overrides = {"data.balance": "tokens"} if "data.balance" in extra else {}
    key = f"{kind} {reference_overrides}"
    if key not in _references:
        _references[key] = dist.run(1, record_training,
                                    layout_config({**base, **reference_overrides}, 1), data_dir,
                                    STEPS)[0]
    reference = _references[key]
    config = layout_config({**base, **extra}, world, dp_replicate=1, **degrees)
    assert config["model"]["sliding_window"] == WINDOW
    for rank, got in enumerate(dist.run(world, record_training, config, data_dir, STEPS)):
        where = f"{layout} rank {rank}"
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
    assert reference["loss"][-1] != reference["loss"][0]
