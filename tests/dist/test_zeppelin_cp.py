"""``data.balance = zeppelin`` (``loom.parallel.zeppelin_cp``): each varlen microbatch's documents
placed over the cp ranks by the Zeppelin planner, trained exactly.

The corpus mixes many short documents (3 to 30 bytes) with long ones (300 to 400 bytes, cut
into pieces of up to 256 predictions): a step's microbatch then holds a long piece, which the
placement spreads zig-zag over a group of cp ranks, beside short ones kept whole on single
ranks (checked: the test is about a step that has both).

* The placement: every token of a microbatch on exactly one cp rank, each rank's shard its own
  tokens (not padded to the longest), a document either whole on one rank or zig-zag over an
  aligned power-of-two group, and no worse than static cp on the runtime's price.
* The runtime's price: a whole document's causal pairs at the model's kernel rate, a grouped
  one's shared evenly by its ranks at the calibrated ring rate; remapped, the busiest
  attention plus the equal split's linear work plus the busiest rank's moved tokens; a
  long-context microbatch's 4309-token document goes to a group of 4 and its short ones stay whole.
* The sub-ring engine (``zeppelin_cp.sub_ring_attention``, cp = 4: a document over all four
  ranks, one over ranks 2-3 only, whole ones on single ranks)
  equals one process's per-document attention (output, dQ, dK, dV); its ring traffic is exactly
  each document's own group's (ranks 0-1 send nothing of the 2-3 document), and a microbatch
  of whole documents sends nothing at all, also where a rank is given no token (it holds one
  padding slot).
* With the remapping layer (``data.zeppelin_remap``) the core on an equal split of the
  microbatch (a 2048-token document over the 4 ranks beside whole ones; 3 tokens over 4 ranks,
  a rank holding none in either layout) equals one process's document attention (output, dQ,
  dK, dV), with the 4 all-to-alls of one forward and backward counted on axis ``remap``.
* The tiled document ring (``context_documents.document_tiles``) equals the dense masked one,
  also where a step-0 tile runs torch's causal kernel and where a split document's chunk pairs
  run as full (non-causal) tiles on it.
* The ``Trainer`` (2 AdamW steps: loss, gradient norm, every gradient) with cp = 2, cp = 4,
  tp = 2 x cp = 2 (sequence parallelism off and on), pp = 2 x cp = 2
  (1f1b; matrix: zb_h1, dualpipev) and an MoE model at cp = 2 (matrix: ep = 2 x cp = 2, and
  cp = 4 with the remapping layer) equals one process
  running the same microbatches (``data.balance = tokens``, the same bins) with per-document
  attention; so does its evaluation loss (cp = 4). In each run every tp rank of a cp rank
  holds the same tokens, the cp ranks hold each microbatch's tokens exactly once between
  them (with dp > 1 the placement spans the dp x cp ranks: ``test_zeppelin_dp.py``), some
  document is cut over several ranks (each of them sends on the cp axis: its ring ran) and
  some is kept whole.
* The config accepts zeppelin with dp, with tp (also with sequence parallelism) and with pp,
  and refuses, by name, zeppelin on one rank (neither cp nor dp > 1) or with Ulysses.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.config import from_dict, load_config, model_args, resolve
from loom.data.loader import prepare_data
from loom.data.packing import DocumentBatch
from loom.errors import ConfigError
from loom.models.document_attention import DocumentMask
from loom.parallel.comm import CommLedger
from loom.parallel.context import CPLayout, ContextParallelAttention, new_cp_groups
from loom.parallel.context_documents import (PAD_SLOT, block_backward, block_forward,
                                             document_tiles, take_shard)
from loom.parallel.zeppelin_cp import aligned_blocks, ring_block, with_remap
from loom.parallel.zeppelin_placement import (RING_SLOWDOWN, cp_step_price, document_runs,
                                              model_token_costs, per_token_square,
                                              place_over_cp, tiled_attention,
                                              zeppelin_shard_indices)
from loom.data.zeppelin import (UNIT, Partition, Ranks, TokenCosts, group_time,
                                partition_static_cp, partition_tokens)
from loom.testing.parity import (assert_parity, layout_config, record_training,
                                 train_and_record)
from loom.train.trainer import Trainer
from tests.conftest import matrix
from tests.data_fixtures import DataCfg, prepared_documents

STEPS = 2
SEQ_LEN, BUDGET = 256, 384  # split length, tokens per microbatch
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = {  # name: (world, degrees[, other overrides])
    "cp2": (2, {"cp": 2, "dp_replicate": 1}),
    "cp4": (4, {"cp": 4, "dp_replicate": 1}),
    # each tp rank of a cp rank: the same placement, its shard of the heads, its sub-rings
    # among the cp ranks of its own tp index
    "tp2-cp2": (4, {"cp": 2, "tp": 2, "dp_replicate": 1}),
    "tp2sp-cp2": (4, {"cp": 2, "tp": 2, "dp_replicate": 1, "sequence_parallel": True}),
    # the same placement on every stage; each stage's sub-rings among its own cp ranks, run
    # in the schedule's order (also split backward passes, and dualpipev's two directions)
    "pp2-cp2": (4, {"cp": 2, "pp": 2, "dp_replicate": 1}),
    "pp2-cp2-zb": (4, {"cp": 2, "pp": 2, "dp_replicate": 1, "schedule": "zb_h1"}),
    "pp2-cp2-dualpipev": (4, {"cp": 2, "pp": 2, "dp_replicate": 1, "schedule": "dualpipev"},
                          {"model.n_layers": 4, "train.global_batch_tokens": 4 * BUDGET}),
    # an MoE model: each document's expert counts summed over the cp ranks holding its parts
    "moe-cp2": (2, {"cp": 2, "dp_replicate": 1}, {"model.preset": "tiny-moe"}),
    "moe-cp4-remap": (4, {"cp": 4, "dp_replicate": 1},
                      {"model.preset": "tiny-moe", "data.zeppelin_remap": True}),
    "moe-ep2-cp2": (4, {"cp": 2, "ep": 2, "dp_replicate": 1}, {"model.preset": "tiny-moe"}),
    # all three at once (8 ranks): each (tp, pp) coordinate's cp ranks place and ring alike
    "tp2sp-pp2-cp2": (8, {"cp": 2, "tp": 2, "pp": 2, "dp_replicate": 1,
                          "sequence_parallel": True}),
}
# tp2-cp2 in the matrix: tp2sp-cp2 runs the same tp split with sequence parallelism on top
CI_LAYOUTS = ["cp2", "cp4", "tp2sp-cp2", "pp2-cp2", "moe-cp2"]


def write_long_tail(directory: Path, count: int, seed: int) -> None:
    """``count`` text files: one in eight 300 to 400 bytes, the others 3 to 30 (log-uniform)."""
    rng = random.Random(seed)
    for i in range(count):
        length = rng.randint(300, 400) if i % 8 == 3 else int(3 * 10 ** rng.random())
        text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(length))
        (directory / f"doc{i:04d}.txt").write_text(text)


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory) -> tuple[str, dict]:
    data_dir, overrides = prepared_documents(tmp_path_factory, "zeppelin_docs", SEQ_LEN, count=240,
                                             seed=5, write=write_long_tail)
    overrides.update({"data.packing": "varlen", "data.tokens_per_microbatch": BUDGET,
                      "train.global_batch_tokens": 2 * BUDGET, "model.preset": "tiny",
                      "model.n_layers": 2, "train.steps": STEPS})
    return data_dir, overrides


def first_step_placements(ctx, config_table: dict, data_dir: str) -> dict:
    """The first step's microbatch runs and each one's placement over cp = 2 and 4 ranks."""
    config = from_dict(config_table)
    trainer = Trainer(config, data_dir, None, ctx)
    costs = model_token_costs(model_args(config))
    out: dict = {"runs": [], "sizes": {2: [], 4: []}}
    for mb in trainer.loader.next_batch().microbatches:
        runs = document_runs(mb.document_ids[0].numpy())
        out["runs"].append(runs)
        for cp in (2, 4):
            out["sizes"][cp].append(list(place_over_cp(runs, cp, costs).size))
    return out


def test_the_step_holds_a_long_document_on_a_group_and_short_ones_whole(dist, long_tail):
    data_dir, base = long_tail
    config = layout_config({**base, "data.balance": "tokens"}, 1)
    got = dist.run(1, first_step_placements, config, data_dir)[0]
    for cp in (2, 4):
        sizes = [g for mb in got["sizes"][cp] for g in mb]
        assert max(sizes) > 1 and sizes.count(1) >= 4, (cp, got)


def test_every_token_is_on_one_rank_and_groups_are_aligned():
    runs = [120, 5, 9, 3, 17, 4, 28, 6]
    ids = torch.from_numpy(np.repeat(np.arange(len(runs)), runs))[None]
    costs = model_token_costs(model_args(resolve(load_config(None, {"model.preset": "tiny"}),
                                                 1)))
    for cp in (2, 4):
        plan = place_over_cp(runs, cp, costs)
        shards = [zeppelin_shard_indices(ids, cp, r, costs)[0] for r in range(cp)]
        assert [len(s) for s in shards] == plan.rank_tokens().tolist()  # no padding
        held = torch.cat(shards)
        assert sorted(held.tolist()) == list(range(sum(runs)))
        for b, g in zip(plan.start, plan.size):
            assert g & (g - 1) == 0 and b % g == 0 and b + g <= cp
        assert max(plan.size) > 1 and 1 in plan.size  # both kinds in this microbatch
        static = partition_static_cp(runs, Ranks(cp, per_node=cp), cp, costs)
        assert cp_step_price(plan) <= cp_step_price(static)


def test_the_runtime_price_is_causal_pairs_at_the_kernel_rate_and_a_group_shares_them():
    """A document whole on one rank costs its causal pairs on the model's kernel; one over a
    group of 4 costs each member a quarter of them, ``RING_SLOWDOWN`` times dearer (its tiles
    and merges: calibrated in ``bench/varlen.py --calibrate``)."""
    costs = model_token_costs(model_args(resolve(load_config(None, {"model.preset": "tiny"}),
                                                 1)))
    n, ranks = 8192, Ranks(4, per_node=4)
    whole = Partition("whole", (n,), (2,), (1,), ranks, costs)
    assert tiled_attention(whole).tolist() == [0, 0, n * n / 2 * costs.attention, 0]
    grouped = Partition("grouped", (n,), (0,), (4,), ranks, costs)
    np.testing.assert_allclose(tiled_attention(grouped),
                               [RING_SLOWDOWN * n * n / 8 * costs.attention] * 4, rtol=1e-12)


def test_a_long_context_document_beyond_a_ranks_share_goes_to_a_group_and_short_ones_stay_whole():
    """A long-context microbatch (``bench/varlen.py --corpora longtail-long``, seed 0, its second
    microbatch): the 4309-token document alone would be more attention than a rank's share, so
    it is cut over all 4 ranks; the 14 short ones stay whole; and the plan is priced well under
    the ``tokens`` deal (every document whole)."""
    runs = [4309, 68, 25, 190, 983, 146, 43, 44, 701, 17, 105, 69, 363, 542, 271]
    costs = model_token_costs(model_args(resolve(load_config(None, {"model.preset": "tiny"}),
                                                 1)))
    plan = place_over_cp(runs, 4, costs)
    assert plan.size == (4,) + (1,) * 14
    tokens = partition_tokens(runs, Ranks(4, per_node=4), costs)
    assert cp_step_price(plan) < 0.6 * cp_step_price(tokens)


def test_the_planner_sizes_groups_in_the_units_the_runtime_prices():
    """The planner's ``group_time`` prices a causal document of n tokens as attention x n²,
    the runtime's ``tiled_attention`` as attention x n²/2 query-key pairs: converted by
    ``per_token_square``, a document whole on one rank costs the same in both, so the sizing
    compares attention and linear work at the runtime's ratio (not twice the attention)."""
    costs = model_token_costs(model_args(resolve(load_config(None, {"model.preset": "tiny"}),
                                                 1)))
    ranks = Ranks(1, per_node=1)
    for n in (1, 17, 4309):
        whole = partition_tokens([n], ranks, costs)
        assert group_time(n, 1, True, per_token_square(costs)) == pytest.approx(
            tiled_attention(whole)[0], rel=1e-12)


def test_tiled_blocks_equal_the_dense_masked_block():
    gen = torch.Generator().manual_seed(0)
    ids_q = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, -1])
    pos_q = np.array([0, 1, 2, 0, 1, 3, 4, 5, 6, 0])
    ids_k = np.array([2, 2, 0, 0, 3, 1, 1, 1, -1, -1])
    pos_k = np.array([0, 1, 3, 4, 0, 0, 1, 2, 0, 0])
    q = torch.randn(1, 4, 10, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 10, 8, generator=gen, dtype=torch.float64)
    real = ids_q >= 0
    dense = torch.from_numpy((ids_q[:, None] == ids_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
                             & real[:, None])[None]
    for tile_tokens in (1, 4, 128):  # one tile per document, merged, all in one
        tiles = document_tiles(ids_q, pos_q, ids_k, pos_k, torch.device("cpu"), tile_tokens)
        out_t, lse_t = block_forward(q, k, v, tiles)
        out_d, lse_d = block_forward(q, k, v, dense)
        torch.testing.assert_close(out_t, out_d)
        torch.testing.assert_close(lse_t, lse_d)
        seen = torch.isfinite(lse_d[0, 0])
        assert 0 < int(seen.sum()) < 9  # rows that see keys and rows that see none
        dout = torch.randn(out_d.shape, generator=gen, dtype=torch.float64) * seen[:, None]
        # the backward takes rows' final statistics; a row that sees nothing has none to give
        lse_fin = lse_d.masked_fill(~seen, 0.0)
        for a, b in zip(block_backward(q, k, v, out_d, dout, lse_fin, tiles),
                        block_backward(q, k, v, out_d, dout, lse_fin, dense)):
            torch.testing.assert_close(a, b)


def test_own_key_tiles_run_the_causal_kernel_and_equal_the_dense_block():
    """Ring step 0: a whole document and a document's two zig-zag chunks are causal tiles."""
    gen = torch.Generator().manual_seed(1)
    ids = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, -1])
    pos = np.array([0, 1, 2, 3, 0, 1, 2, 1, 2, 7, 8, 0])  # document 2: chunks [1, 2], [7, 8]
    tiles = document_tiles(ids, pos, ids, pos, torch.device("cpu"), own_keys=True)
    assert [t.kernel for t in tiles] == ["causal"] * 3
    q = torch.randn(1, 4, 12, 8, generator=gen)
    k = torch.randn(1, 2, 12, 8, generator=gen)
    v = torch.randn(1, 2, 12, 8, generator=gen)
    dense = torch.from_numpy((ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])
                             & (ids >= 0)[:, None])[None]
    out_t, lse_t = block_forward(q, k, v, tiles)
    out_d, lse_d = block_forward(q, k, v, dense)
    torch.testing.assert_close(out_t, out_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_t, lse_d, rtol=1e-5, atol=1e-6)
    seen = torch.isfinite(lse_d[0, 0])
    dout = torch.randn(out_d.shape, generator=gen) * seen[:, None]
    lse_fin = lse_d.masked_fill(~seen, 0.0)
    for a, b in zip(block_backward(q, k, v, out_d, dout, lse_fin, tiles),
                    block_backward(q, k, v, out_d, dout, lse_fin, dense)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_split_documents_chunk_pairs_run_as_full_tiles_and_equal_the_dense_block():
    """Another rank's keys: a long document's chunks pair up fully visible or invisible (full
    tiles on torch's kernel); a short document, and one whose chunks overlap, stay masked."""
    gen = torch.Generator().manual_seed(2)
    ids_q = np.array([0] * 6 + [1, 1] + [2] * 4 + [-1])
    pos_q = np.array([3, 4, 5, 12, 13, 14, 5, 6, 0, 1, 2, 3, 0])
    ids_k = np.array([0] * 6 + [1, 1] + [2] * 4 + [-1])
    pos_k = np.array([0, 1, 2, 15, 16, 17, 1, 2, 1, 2, 3, 4, 0])  # document 2 overlaps
    tiles = document_tiles(ids_q, pos_q, ids_k, pos_k, torch.device("cpu"), tile_tokens=4)
    assert sorted(t.kernel for t in tiles) == ["full", "full", "masked", "masked"]
    q = torch.randn(1, 4, 13, 8, generator=gen)
    k = torch.randn(1, 2, 13, 8, generator=gen)
    v = torch.randn(1, 2, 13, 8, generator=gen)
    dense = torch.from_numpy((ids_q[:, None] == ids_k[None, :])
                             & (pos_k[None, :] <= pos_q[:, None]) & (ids_q >= 0)[:, None])[None]
    out_t, lse_t = block_forward(q, k, v, tiles)
    out_d, lse_d = block_forward(q, k, v, dense)
    torch.testing.assert_close(out_t, out_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_t, lse_d, rtol=1e-5, atol=1e-6)
    seen = torch.isfinite(lse_d[0, 0])
    assert 0 < int(seen.sum()) < 13
    dout = torch.randn(out_d.shape, generator=gen) * seen[:, None]
    lse_fin = lse_d.masked_fill(~seen, 0.0)
    for a, b in zip(block_backward(q, k, v, out_d, dout, lse_fin, tiles),
                    block_backward(q, k, v, out_d, dout, lse_fin, dense)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_documents_ring_is_the_smallest_aligned_block_that_holds_it():
    assert aligned_blocks(4) == [(0, 4), (0, 2), (2, 2)]
    assert aligned_blocks(6) == [(0, 6), (0, 4), (0, 2), (2, 2), (4, 2)]
    assert [ring_block(a, b, 4) for a, b in ((1, 1), (0, 1), (2, 3), (1, 2), (0, 3))] == [
        (1, 1), (0, 2), (2, 2), (0, 4), (0, 4)]
    assert ring_block(4, 5, 6) == (4, 2) and ring_block(3, 4, 6) == (0, 6)


# cp = 4: a document over all four ranks, one over ranks 2-3, whole ones on ranks 0, 1 and 3,
# rank 2 holding only its rings' tokens (each document's (start, size), in row order)
SUB_RING_PLACEMENT = {"lengths": (40, 9, 24, 5, 3, 7), "start": (0, 0, 2, 1, 1, 3),
                      "size": (4, 1, 2, 1, 1, 1)}
WHOLE_PLACEMENT = {"lengths": (9, 5, 3, 7), "start": (0, 1, 1, 3), "size": (1,) * 4}  # 2: none
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _placed(placement: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor, DocumentBatch]:
    """The row's document ids, this rank's indices into it, and its shard of the row."""
    partition = Partition("test", ranks=Ranks(4, per_node=4), costs=UNIT, **placement)
    ids = torch.from_numpy(np.repeat(np.arange(len(placement["lengths"])),
                                     placement["lengths"]))[None]
    mine = partition.token_indices(rank)
    index = torch.from_numpy(mine if len(mine) else np.array([PAD_SLOT]))[None]  # as the trainer
    zeros = torch.zeros_like(ids)
    batch = DocumentBatch(zeros, zeros, DocumentMask(ids).positions(), ids)
    return ids, index, take_shard(batch, index)


def _qkv(S: int):
    g = torch.Generator().manual_seed(3)
    q_shape, kv_shape = (1, HEADS, S, HEAD_DIM), (1, KV_HEADS, S, HEAD_DIM)
    return (torch.randn(q_shape, generator=g), torch.randn(kv_shape, generator=g),
            torch.randn(kv_shape, generator=g), torch.randn(q_shape, generator=g))


def sub_ring_core(ctx, placement: dict):
    """Output, dQ, dK, dV and send bytes of the cp = 4 core with sub-rings on this rank's
    shard of a seeded q, k, v (the forward's plan reused by a second layer's call)."""
    groups = new_cp_groups([list(range(4))], CPLayout.from_mode("ring", 4, 0), ctx.rank,
                           sub_rings=True)
    ids, index, local = _placed(placement, groups.cp_rank)
    at = index[0].clamp(min=0)
    q, k, v, dout = (t[:, :, at].clone().requires_grad_() for t in _qkv(ids.shape[1]))
    ledger = CommLedger()
    core = ContextParallelAttention(groups, ledger)
    documents = DocumentMask(local.document_ids, local.positions)
    out = core(q, k, v, documents=documents)
    out.backward(dout.detach())
    sends = ledger.get("cp", "send").payload_bytes
    core(q, k, v, documents=documents)  # the same forward's next layer: no new all-gather
    return (index[0], out.detach(), q.grad, k.grad, v.grad, sends,
            ledger.get("cp", "all_gather").calls)


def ring_send_bytes(counts: list[int], j: int) -> int:
    """What member ``j`` of a ring with these token counts sends in one forward and backward:
    key/value hops both ways (fp32) and the travelling dK/dV sum (fp32)."""
    g, per_token = len(counts), 2 * KV_HEADS * HEAD_DIM * 4
    kv = sum(counts[(j - hop + 1) % g] for hop in range(1, g))
    dkv = sum(counts[(j - hop) % g] for hop in range(1, g))
    return (2 * kv + dkv) * per_token


def reference_document_attention(lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """One process's per-document attention over documents of ``lengths`` (out, then q, k, v
    with their gradients from a fixed upstream gradient)."""
    ids = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))[None]
    q, k, v, dout = (t.requires_grad_() for t in _qkv(sum(lengths)))
    want = DocumentMask(ids).attention(q, k, v, 0, kernel="segments")
    want.backward(dout.detach())
    return want, q, k, v


def test_sub_rings_are_document_attention_with_traffic_inside_each_group(dist):
    lengths = SUB_RING_PLACEMENT["lengths"]
    want, q, k, v = reference_document_attention(lengths)
    got = [torch.full_like(t, float("nan")) for t in (want, q, k, v)]
    sent, gathers = [], []
    for index, *local, sends, calls in dist.run(4, sub_ring_core, SUB_RING_PLACEMENT):
        for full, part in zip(got, local):
            full[:, :, index] = part
        sent.append(sends)
        gathers.append(calls)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, w, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m: f"{name}: {m}")
    # the 40-token document: 5 tokens per rank; the 24-token one: 12 on each of ranks 2 and 3
    whole_group = [ring_send_bytes([10] * 4, j) for j in range(4)]
    assert sent == [whole_group[0], whole_group[1], whole_group[2] + ring_send_bytes([12, 12], 0),
                    whole_group[3] + ring_send_bytes([12, 12], 1)]
    assert gathers == [2] * 4  # token counts, then (id, position) pairs: once per forward


def test_whole_documents_need_no_ring_traffic(dist):
    for index, *_, sends, calls in dist.run(4, sub_ring_core, WHOLE_PLACEMENT):
        assert sends == 0 and calls == 2


REMAP_COSTS = TokenCosts(linear=4.0, attention=1.0, remap_intra=1.0)


def remapped_core(ctx, lengths: list[int]):
    """The cp = 4 core with the remapping layer on this rank's linear-layout shard (as the
    trainer cuts it) of a seeded q, k, v: its indices, output, dQ, dK, dV and the remap
    all-to-all calls of one forward and backward."""
    groups = new_cp_groups([list(range(4))], CPLayout.from_mode("ring", 4, 0), ctx.rank,
                           sub_rings=True)
    groups = replace(groups, sub_rings=with_remap(groups.sub_rings, REMAP_COSTS, 4))
    ids = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))[None]
    index = zeppelin_shard_indices(ids, 4, groups.cp_rank, REMAP_COSTS, 4, remap=True)
    zeros = torch.zeros_like(ids)
    local = take_shard(DocumentBatch(zeros, zeros, DocumentMask(ids).positions(), ids), index)
    at = index[0].clamp(min=0)
    q, k, v, dout = (t[:, :, at].clone().requires_grad_() for t in _qkv(ids.shape[1]))
    ledger = CommLedger()
    out = ContextParallelAttention(groups, ledger)(
        q, k, v, documents=DocumentMask(local.document_ids, local.positions))
    out.backward(dout.detach())
    return (index[0], out.detach(), q.grad, k.grad, v.grad,
            ledger.get("remap", "all_to_all").calls, ledger.get("cp", "send").payload_bytes)


@pytest.mark.parametrize("lengths", [[2048, 30, 20, 10], [1, 1, 1]])
def test_remapped_core_is_document_attention_on_an_equal_split(dist, lengths):
    """``data.zeppelin_remap`` in the core: a 2048-token document over all 4 ranks beside
    whole ones, and 3 tokens over 4 ranks (a rank holds none in either layout: a padding slot,
    and an empty share of the all-to-alls); output, dQ, dK, dV as one process's document
    attention."""
    want, q, k, v = reference_document_attention(lengths)
    got = [torch.full_like(t, float("nan")) for t in (want, q, k, v)]
    counts, sent = [], []
    for index, *local, calls, sends in dist.run(4, remapped_core, lengths):
        real = index != PAD_SLOT
        for full, part in zip(got, local):
            full[:, :, index[real]] = part[:, :, real]
        counts.append(int(real.sum()))
        sent.append(sends)
        assert calls == 4  # q, k, v out and the output back; their gradients the other way
    assert max(counts) - min(counts) <= 1 and sum(counts) == sum(lengths)
    assert all(sent) if lengths[0] > 1 else not any(sent)  # the long document's ring ran
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, w, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m: f"{name}: {m}")


_reference: dict[str, dict] = {}


def record_placements(trainer: Trainer) -> list[tuple[list, list]]:
    """The list ``trainer`` will fill, per microbatch it shards, with the (document id,
    position) pairs of the whole microbatch and of this rank's shard."""
    placed: list[tuple[list, list]] = []
    shard = trainer._shard_documents

    def recording(batch: DocumentBatch) -> DocumentBatch:
        local = shard(batch)
        placed.append(tuple(list(zip(b.document_ids[0].tolist(), b.positions[0].tolist()))
                            for b in (batch, local)))
        return local

    trainer._shard_documents = recording
    return placed


def assert_linear_layout(ranks: list[dict], domain: int, cp: int) -> None:
    """Each rank's shard is the remapped placement's linear layout: an equal split of the
    merged row (counts differ by one at most), every token once; some microbatch holds a
    document longer than a rank's share, and the attention layout it is remapped from keeps
    some document whole and cuts some over a group."""
    by_place = {got["domain_rank"]: got for got in ranks}
    assert sorted(by_place) == list(range(domain))
    rows = [[row for row, _ in got["placed"]] for got in ranks]
    assert all(r == rows[0] for r in rows)
    grouped = whole = longer = 0
    for mb, row in enumerate(rows[0]):
        shards = [by_place[p]["placed"][mb][1] for p in range(domain)]
        counts = [len(shard) for shard in shards]
        assert max(counts) - min(counts) <= 1 and sum(counts) == len(row), counts
        assert sorted(pair for shard in shards for pair in shard) == sorted(row)
        runs = document_runs(np.array([doc for doc, _ in row]))
        part = place_over_cp(runs, domain, ranks[0]["costs"], cp, remap=True)
        assert part.remapped
        for p in range(domain):
            assert [row[i] for i in part.linear_layout()[p]] == shards[p]
        grouped += sum(g > 1 for g in part.size)
        whole += sum(g == 1 for g in part.size)
        longer += max(runs) > len(row) / domain
    assert longer and whole and grouped, (longer, whole, grouped)


def record_placed_training(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``record_training``, plus where this rank sits (its cp, tp and data coordinates, whether
    tp is applied), each microbatch's (document id, position) pairs whole and in this rank's
    shard, and the bytes it sent on the cp axis (the sub-rings' hops)."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    placed = record_placements(trainer)
    record = train_and_record(trainer, steps)
    coords = trainer.grid.coords(ctx.rank)
    record.update(placed=placed, tp_applied=trainer.tp is not None,
                  sequence_parallel=trainer.tp is not None and trainer.tp.sequence_parallel,
                  cp_sent=trainer.ledger.get("cp", "send").payload_bytes,
                  where=(coords["cp"], coords["tp"],
                         tuple(v for k, v in sorted(coords.items()) if k not in ("cp", "tp"))))
    return record


def assert_placed_over_cp(ranks: list[dict], cp: int) -> None:
    """Every tp rank of a cp rank holds the same tokens; a data coordinate's cp ranks hold each
    microbatch's tokens exactly once between them, some document cut over several ranks (its
    ring ran: each of them sent on the cp axis) and some kept whole."""
    by_place = {}
    for got in ranks:
        by_place.setdefault((got["where"][2], got["where"][0]), []).append(got)
    for alike in by_place.values():  # one cp rank's tp ranks
        assert all(got["placed"] == alike[0]["placed"] for got in alike)
        assert len({got["cp_sent"] for got in alike}) == 1
    for data in {place for place, _ in by_place}:
        shards = [by_place[data, c][0]["placed"] for c in range(cp)]
        split = whole = 0
        in_rings: set[int] = set()
        for mb in range(len(shards[0])):
            row = shards[0][mb][0]
            held = [pair for c in range(cp) for pair in shards[c][mb][1] if pair[0] >= 0]
            assert sorted(held) == sorted(p for p in row if p[0] >= 0)
            ranks_of: dict[int, set] = {}
            for c in range(cp):
                for doc, _ in shards[c][mb][1]:
                    ranks_of.setdefault(doc, set()).add(c)
            split += sum(len(r) > 1 for d, r in ranks_of.items() if d >= 0)
            in_rings.update(c for d, r in ranks_of.items() if d >= 0 and len(r) > 1 for c in r)
            whole += sum(len(r) == 1 for d, r in ranks_of.items() if d >= 0)
        assert split and whole, (split, whole)
        assert all(got["cp_sent"] > 0 for c in in_rings for got in by_place[data, c])


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=CI_LAYOUTS))
def test_zeppelin_under_cp_matches_one_process(dist, long_tail, layout):
    data_dir, base = long_tail
    world, degrees, *other = LAYOUTS[layout]
    base = {**base, **(other[0] if other else {})}
    # the same bins: tokens' deal (remapping is Zeppelin's own: one process has none)
    one = {k: v for k, v in base.items() if k != "data.zeppelin_remap"}
    key = repr(sorted(one.items()))
    if key not in _reference:
        _reference[key] = dist.run(1, record_training,
                                   layout_config({**one, "data.balance": "tokens"}, 1),
                                   data_dir, STEPS)[0]
    reference = _reference[key]
    config = layout_config({**base, "data.balance": "zeppelin", "parallel.cp_mode": "ring",
                            "metrics.comm": True}, world, **degrees)
    ranks = dist.run(world, record_placed_training, config, data_dir, STEPS)
    for rank, got in enumerate(ranks):
        where = f"zeppelin {layout} rank {rank}"
        assert got["tp_applied"] == (degrees.get("tp", 1) > 1)
        assert got["sequence_parallel"] == degrees.get("sequence_parallel", False)
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
    if not base.get("data.zeppelin_remap"):  # remapped shards are the equal linear split
        assert_placed_over_cp(ranks, degrees["cp"])
    assert reference["loss"][-1] != reference["loss"][0]


def test_a_remapped_price_is_the_busiest_attention_plus_the_equal_split_and_the_moves():
    """Remapped, the attention and linear stages each wait for their busiest rank, the linear
    one on the equal split, plus the busiest rank's remapped tokens at ``remap_intra``."""
    costs = TokenCosts(linear=10.0, attention=1.0, remap_intra=3.0)
    ranks = Ranks(2, per_node=2)
    part = Partition("zeppelin", (8, 2), (0, 1), (1, 1), ranks, costs, remapped=True)
    attention = tiled_attention(part)  # 8 tokens whole on rank 0, 2 on rank 1: 32 and 2 pairs
    assert attention.tolist() == [32.0, 2.0]
    moved = 3  # rank 0 holds 8, its quota 5: 3 go to rank 1
    assert cp_step_price(part) == 32.0 + 5 * 10.0 + moved * 3.0
    assert cp_step_price(replace(part, remapped=False)) == 32.0 + 8 * 10.0


def evaluation_loss(ctx, config_table: dict, data_dir: str) -> float:
    return Trainer(from_dict(config_table), data_dir, None, ctx).evaluate()


def check_evaluation(dist, base: dict, seq_len: int, tmp_path, world: int,
                     **degrees: int) -> None:
    """Validation under zeppelin on ``world`` ranks equals one process's under ``tokens``
    (the corpus re-prepared with half its files for validation, for whole steps)."""
    data_dir = str(tmp_path / "half_validation")
    prepare_data(DataCfg(source=base["data.source"], extensions=(".txt",), seq_len=seq_len,
                         val_fraction=0.5), data_dir)
    base = {**base, "data.val_fraction": 0.5, "train.eval_batches": 2}
    want = dist.run(1, evaluation_loss, layout_config({**base, "data.balance": "tokens"}, 1),
                    data_dir)[0]
    config = layout_config({**base, "data.balance": "zeppelin"}, world, **degrees)
    assert want == want  # not NaN: the split holds whole steps
    for got in dist.run(world, evaluation_loss, config, data_dir):
        assert got == pytest.approx(want, rel=1e-5)


def test_evaluation_under_zeppelin_matches_one_process(dist, long_tail, tmp_path):
    _, base = long_tail
    check_evaluation(dist, {**base, "parallel.cp_mode": "ring"}, SEQ_LEN, tmp_path, 4, cp=4,
                     dp_replicate=1)


def zeppelin_config(overrides: dict, world: int):
    """A resolved varlen config with data.balance = zeppelin and ``overrides``."""
    return resolve(load_config(None, {"model.preset": "tiny", "data.seq_len": "32",
                                      "data.packing": "varlen", "data.balance": "zeppelin",
                                      **overrides}), world)


def test_zeppelin_is_accepted_with_a_cp_ring_and_dp_tp_or_pp():
    config = zeppelin_config({"parallel.cp": "2", "parallel.dp_replicate": "2"}, 4)
    assert config.data.balance == "zeppelin" and config.parallel.cp == 2
    config = zeppelin_config({"parallel.cp": "2", "parallel.tp": "2"}, 4)
    assert config.parallel.tp == 2 and not config.parallel.sequence_parallel
    # with sequence parallelism too: a cp rank's shard is its own tokens, split unevenly over
    # its tp ranks as varlen is at cp = 1 (the static cp shard too, with tokens' deal:
    # tests/dist/test_context_documents.py trains both against one process)
    sp = {"parallel.cp": "2", "parallel.tp": "2", "parallel.sequence_parallel": "true"}
    config = zeppelin_config(sp, 4)
    assert config.parallel.sequence_parallel
    assert zeppelin_config({**sp, "data.balance": "tokens"}, 4).parallel.sequence_parallel
    assert zeppelin_config({"parallel.cp": "2", "parallel.pp": "2"}, 4).parallel.pp == 2


@pytest.mark.parametrize("overrides, world, field, words", [
    ({}, 1, "data.balance", "parallel.cp > 1"),
    ({"parallel.cp": "2", "parallel.cp_mode": "ulysses"}, 2, "parallel.cp_mode", "ring"),
    ({"data.packing": "pack", "parallel.cp": "2"}, 2, "data.balance", "varlen"),
])
def test_zeppelin_refuses_what_is_not_built_by_name(overrides, world, field, words):
    with pytest.raises(ConfigError, match=words) as info:
        zeppelin_config(overrides, world)
    assert info.value.field_name == field
