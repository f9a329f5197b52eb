"""Documents under context parallelism: packed rows and varlen microbatches split over cp ranks
(``loom.parallel.context_documents``) are one process's per-document attention.

The documents are chosen to be awkward: a row that is one single document, a document longer
than a whole cp shard, documents shorter than ``2r`` tokens (some of their zig-zag chunks are
empty), padding (``pack``'s padding run), and a varlen microbatch of 29 tokens, which no cp
layout divides (cp padding, kept out of attention and out of the loss).

* The sharding: every token lands on exactly one cp rank, every rank the same length, each
  document's tokens spread zig-zag over the ring groups, and pack rows need no padding.
* The attention core (output, dQ, dK, dV) of cp=2 ring, cp=2 Ulysses, cp=4 hybrid (u=2,
  r=2) and cp=4 all-gather, without and with a sliding window (``model.sliding_window``,
  inside each document), equals ``DocumentMask.attention`` on the whole row; its
  communication is the document-free core's plus one all-gather of (id, position) pairs per
  forward.
* A model (8 query, 4 key/value heads) trained 2 AdamW steps in fp32 on both kinds of batch:
  the loss (summed over each rank's real tokens, divided by the step's real tokens) and every
  gradient equal one process's.
* The ``Trainer`` (2 AdamW steps: loss, gradient norm, every gradient) equals one process with
  varlen under cp=2 ring and Ulysses, with selective and with full recomputation, cp=4 hybrid,
  dp=2 x cp=2, tp=2 x cp=2 (Ulysses) and pp=2 x cp=2, and with pack under cp=2 ring; with
  varlen and pack under cp=2 all-gather (Llama 3's context parallelism with document masks);
  tp=2 with sequence parallelism x cp=2 (ring: varlen and pack; Ulysses: varlen), whose cp
  shards of odd length are split over tp unevenly.
* The config accepts pack and varlen in every cp mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.config import load_config, resolve
from loom.data.packing import IGNORE_INDEX, PAD_DOCUMENT, DocumentBatch
from loom.models.document_attention import DocumentMask
from loom.models.layers import TransformerArgs
from loom.models.llama import Transformer, reset_parameters
from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.context import (CPLayout, ContextParallelAttention, apply_context_parallel,
                                   new_cp_groups, reduce_gradients_over_cp, shard_documents)
from loom.parallel.context_documents import PAD_SLOT, document_shard_indices
from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import matrix
from tests.data_fixtures import prepared_documents

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=64,
                       max_seq_len=64)
SEED, LR, STEPS = 1234, 3e-3, 2
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = [("ring", 2, 0), ("ulysses", 2, 0), ("hybrid", 4, 2),  # (mode, cp, Ulysses degree)
           ("allgather", 4, 0)]


def _ids(lengths: list[int], pad: int = 0) -> list[int]:
    return [d for d, n in enumerate(lengths) for _ in range(n)] + [PAD_DOCUMENT] * pad


# pack: two rows of 32 tokens. Row 0 is one document; row 1 has documents of 1, 3 and 2 tokens
# (shorter than 2r = 4), one of 17 (longer than a cp=2 shard of 16) and padding.
PACK_IDS = torch.tensor([_ids([32]), _ids([1, 3, 17, 2, 6], pad=3)])
# varlen: one microbatch of 29 tokens, no padding of its own
VARLEN_IDS = torch.tensor([_ids([1, 19, 3, 2, 4])])
BATCHES = {"pack": PACK_IDS, "varlen": VARLEN_IDS}


def _batch(ids_BS: torch.Tensor, seed: int) -> DocumentBatch:
    """Random tokens in the documents of ``ids_BS``; padding as ``loom.data.packing`` makes it."""
    g = torch.Generator().manual_seed(seed)
    pad = ids_BS == PAD_DOCUMENT
    inputs = torch.randint(0, ARGS.vocab_size, ids_BS.shape, generator=g).masked_fill(pad, 0)
    targets = torch.randint(0, ARGS.vocab_size, ids_BS.shape, generator=g)
    return DocumentBatch(inputs, targets.masked_fill(pad, IGNORE_INDEX),
                         DocumentMask(ids_BS).positions(), ids_BS)


@pytest.mark.parametrize("mode, cp, ulysses", LAYOUTS)
@pytest.mark.parametrize("kind", BATCHES)
def test_every_token_is_on_one_rank_zigzag_per_document(kind, mode, cp, ulysses):
    layout = CPLayout.from_mode(mode, cp, ulysses)
    ids = BATCHES[kind]
    shards = [document_shard_indices(ids, layout.ring, layout.ulysses, rank) for rank in range(cp)]
    assert len({s.shape for s in shards}) == 1  # the same length on every rank
    for b in range(ids.shape[0]):
        held = torch.cat([s[b][s[b] != PAD_SLOT] for s in shards])
        assert sorted(held.tolist()) == list(range(ids.shape[1]))
    if kind == "pack":  # rows of a multiple of 2 cp tokens: no cp padding at all
        assert all((s != PAD_SLOT).all() for s in shards)
    else:  # 29 tokens: padded, at most a slot per ring group and the rounding to u
        assert shards[0].shape[1] * cp - ids.shape[1] <= layout.ring + cp
    if layout.ring > 1:  # the long document: each ring group holds an early and a late chunk
        row, doc = ids.shape[0] - 1, (17 if kind == "pack" else 19)
        tokens = (ids[row] == (2 if kind == "pack" else 1)).nonzero().flatten().tolist()
        assert len(tokens) == doc
        counts = []
        for g in range(layout.ring):
            mine = sorted(t for i in range(layout.ulysses)
                          for t in shards[g * layout.ulysses + i][row].tolist() if t in tokens)
            runs = 1 + sum(b != a + 1 for a, b in zip(mine, mine[1:]))
            assert runs <= 2, (g, mine)
            if g == 0:  # chunks 0 and 2r-1: the document's first and last tokens
                assert mine[0] == tokens[0] and mine[-1] == tokens[-1] and runs == 2
            counts.append(len(mine))
        assert max(counts) - min(counts) <= 1, counts


def _qkv(shape_BS: torch.Size):
    g = torch.Generator().manual_seed(7)
    B, S = shape_BS
    q_shape, kv_shape = (B, 8, S, 16), (B, 4, S, 16)
    return (torch.randn(q_shape, generator=g), torch.randn(kv_shape, generator=g),
            torch.randn(kv_shape, generator=g), torch.randn(q_shape, generator=g))


def cp_document_core(ctx, mode, cp, ulysses, ids, window=0):
    """Output and dQ/dK/dV of the cp core on this rank's shard of a seeded q/k/v."""
    layout = CPLayout.from_mode(mode, cp, ulysses)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    index = document_shard_indices(ids, layout.ring, layout.ulysses, groups.cp_rank)
    local = shard_documents(_batch(ids, 0), groups.cp_rank, layout)
    at = index.clamp(min=0)[:, None, :, None]
    q, k, v, dout = (t.gather(2, at.expand(*t.shape[:2], -1, t.shape[3])) for t in _qkv(ids.shape))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ContextParallelAttention(groups, window=window)(
        q, k, v, documents=DocumentMask(local.document_ids, local.positions))
    out.backward(dout.masked_fill((index == PAD_SLOT)[:, None, :, None], 0.0))
    return index, out.detach(), q.grad, k.grad, v.grad


WINDOWED = [  # a sliding window inside each document: Ulysses sees whole rows; the ring's and
    ("ulysses", 2, 0, 5),  # all-gather's blocks take it in their masks and tiles
    ("ring", 2, 0, 5), ("ring", 4, 0, 3), ("hybrid", 4, 2, 12), ("allgather", 4, 0, 5)]


@pytest.mark.parametrize("mode, cp, ulysses, window", matrix(
    [*((*layout, 0) for layout in LAYOUTS), *WINDOWED],
    ci=[(*layout, 0) for layout in LAYOUTS] + [WINDOWED[0], WINDOWED[1], WINDOWED[4]]))
@pytest.mark.parametrize("kind", BATCHES)
def test_the_core_is_document_attention_on_the_whole_row(dist, kind, mode, cp, ulysses, window):
    ids = BATCHES[kind]
    q, k, v, dout = _qkv(ids.shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want = DocumentMask(ids).attention(q, k, v, window, kernel="segments")
    want.backward(dout)
    got = [torch.full_like(t, float("nan")) for t in (want, q, k, v)]
    for index, *local in dist.run(cp, cp_document_core, mode, cp, ulysses, ids, window):
        for b in range(ids.shape[0]):
            real = index[b] != PAD_SLOT
            for full, part in zip(got, local):
                full[b, :, index[b][real]] = part[b, :, real]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, w, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m: f"{kind} {mode} cp={cp} {name}: {m}")


def cp_document_core_bytes(ctx, mode, cp, ulysses, ids):
    """The ledger of one forward and backward of the cp core on documents, called twice with
    the same ``DocumentMask`` (two layers of one forward)."""
    layout = CPLayout.from_mode(mode, cp, ulysses)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    local = shard_documents(_batch(ids, 0), groups.cp_rank, layout)
    index = document_shard_indices(ids, layout.ring, layout.ulysses, groups.cp_rank)
    at = index.clamp(min=0)[:, None, :, None]
    q, k, v, dout = (t.gather(2, at.expand(*t.shape[:2], -1, t.shape[3])) for t in _qkv(ids.shape))
    ledger = CommLedger()
    core = ContextParallelAttention(groups, ledger)
    documents = DocumentMask(local.document_ids, local.positions)
    for _ in range(2):
        core(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
             documents=documents).backward(dout)
    return index.shape[1], {key: vars(r).copy() for key, r in ledger.records.items()}


@pytest.mark.parametrize("mode, cp, ulysses", LAYOUTS)
def test_the_document_path_adds_one_all_gather_per_forward(dist, mode, cp, ulysses):
    ids = BATCHES["pack"]
    layout = CPLayout.from_mode(mode, cp, ulysses)
    u, r, B = layout.ulysses, layout.ring, ids.shape[0]
    for s_loc, records in dist.run(cp, cp_document_core_bytes, mode, cp, ulysses, ids):
        calls = 2  # two core calls, as two layers of one forward
        gathered = cp * 2 * B * s_loc * 8  # (id, position) int64 of every cp rank, once
        expected = {("cp", "all_gather"): (1, gathered, (cp - 1) / cp * gathered)}
        if u > 1:  # q, k, v, out forward and their gradients backward, as without documents
            payload = calls * 2 * B * s_loc * (2 * 8 + 2 * 4) * 16 * 4
            expected[("cp", "all_to_all")] = (8 * calls, payload, (u - 1) / u * payload)
        if layout.gather:  # keys and values gathered forward and again backward, dK/dV
            kv = 2 * B * 4 * s_loc * 16 * 4  # scattered back (one of each per core call)
            gathered_kv = cp * kv
            expected[("cp", "all_gather")] = (
                1 + 2 * calls, gathered + 2 * calls * gathered_kv,
                (cp - 1) / cp * (gathered + 2 * calls * gathered_kv))
            expected[("cp", "reduce_scatter")] = (calls, calls * gathered_kv,
                                                  calls * (cp - 1) / cp * gathered_kv)
        elif r > 1:  # key/value hops forward, again backward, and the travelling dK/dV sum
            block = 2 * B * (4 // u) * (u * s_loc) * 16 * 4
            sends = 3 * (r - 1) * calls
            expected[("cp", "send")] = (sends, sends * block, sends * block)
            expected[("cp", "recv")] = (sends, sends * block, 0.0)
        assert set(records) == set(expected)
        for key, (n, payload, wire) in expected.items():
            assert records[key]["calls"] == n, (key, records[key])
            assert records[key]["payload_bytes"] == payload, (key, records[key])
            assert records[key]["wire_bytes"] == pytest.approx(wire), (key, records[key])


# -- a model trained on documents ---------------------------------------------------------------
def _model() -> Transformer:
    model = Transformer(ARGS)
    reset_parameters(model, SEED)
    return model


def _train(model, batches, shard, reduce_over_cp, group=None):
    """STEPS AdamW steps; the loss is the sum over real tokens divided by the step's real
    tokens (all cp ranks: the trainer's token-weighted mean), gradients averaged over cp."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = {"loss": [], "grads": []}
    for batch in batches:
        local = shard(batch)
        tokens = (local.targets != IGNORE_INDEX).sum()
        if group is not None:
            comm.all_reduce(tokens, group, axis="cp")
        logits = model(local.inputs, positions=local.positions, document_ids=local.document_ids)
        size = 1 if group is None else torch.distributed.get_world_size(group)
        loss = F.cross_entropy(logits.flatten(0, 1), local.targets.flatten(),
                               reduction="sum") * size / tokens
        loss.backward()
        reduce_over_cp()
        logged = loss.detach()
        if group is not None:
            comm.all_reduce(logged, group, axis="cp")
        out["loss"].append(logged.item() / size)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def _batches(kind: str) -> list[DocumentBatch]:
    return [_batch(BATCHES[kind], seed) for seed in range(STEPS)]


def cp_model_training(ctx, mode, cp, ulysses, kind):
    layout = CPLayout.from_mode(mode, cp, ulysses)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    model = apply_context_parallel(_model(), groups)
    return _train(model, _batches(kind), lambda b: shard_documents(b, groups.cp_rank, layout),
                  lambda: reduce_gradients_over_cp(model, groups), groups.cp)


@pytest.mark.parametrize("mode, cp, ulysses", LAYOUTS)
@pytest.mark.parametrize("kind", BATCHES)
def test_a_model_trained_on_documents_matches_one_process(dist, kind, mode, cp, ulysses):
    want = _train(_model(), _batches(kind), lambda b: b, lambda: None)
    for rank, got in enumerate(dist.run(cp, cp_model_training, mode, cp, ulysses, kind)):
        for step in range(STEPS):
            rtol, atol = (RTOL_FIRST, ATOL_FIRST) if step == 0 else (RTOL, ATOL)
            where = f"{kind} {mode} cp={cp} rank {rank} step {step + 1}"
            torch.testing.assert_close(got["loss"][step], want["loss"][step], rtol=rtol,
                                       atol=atol, msg=lambda m: f"{where} loss: {m}")
            for name, ref in want["grads"][step].items():
                torch.testing.assert_close(got["grads"][step][name], ref, rtol=rtol, atol=atol,
                                           msg=lambda m, n=name: f"{where} {n}: {m}")
    assert want["loss"][1] != want["loss"][0]


# -- the trainer --------------------------------------------------------------------------------
SEQ_LEN, BUDGET = 32, 48  # varlen: split length, tokens per microbatch (4 per step)
TRAINER_LAYOUTS = {  # name: (world, degrees, extra overrides)
    "varlen-ring-cp2": (2, {"cp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ring"}),
    "varlen-ulysses-cp2": (2, {"cp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ulysses"}),
    "pack-ring-cp2": (2, {"cp": 2, "dp_replicate": 1},
                      {"parallel.cp_mode": "ring", "data.packing": "pack"}),
    # recomputation reruns the cp core (selective) or whole blocks (full) with the same keys
    "varlen-ring-cp2-selective": (2, {"cp": 2, "dp_replicate": 1},
                                  {"parallel.cp_mode": "ring", "train.recompute": "selective"}),
    "varlen-ulysses-cp2-full": (2, {"cp": 2, "dp_replicate": 1},
                                {"parallel.cp_mode": "ulysses", "train.recompute": "full"}),
    "varlen-hybrid-cp4": (4, {"cp": 4, "dp_replicate": 1},
                          {"parallel.cp_mode": "hybrid", "parallel.cp_ulysses": 2}),
    # the step's tokens counted over dp x cp; heads split by tp before Ulysses splits them again
    "varlen-dp2-cp2": (4, {"cp": 2, "dp_replicate": 2}, {"parallel.cp_mode": "ring"}),
    "varlen-tp2-cp2": (4, {"cp": 2, "tp": 2, "dp_replicate": 1},
                       {"parallel.cp_mode": "ulysses", "parallel.vocab_parallel": True}),
    # Llama 3's context parallelism: the keys all-gathered, masked per document
    "varlen-allgather-cp2": (2, {"cp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "allgather"}),
    "pack-allgather-cp2": (2, {"cp": 2, "dp_replicate": 1},
                           {"parallel.cp_mode": "allgather", "data.packing": "pack"}),
    "varlen-tp2-sp-cp2-ring": (4, {"cp": 2, "tp": 2, "dp_replicate": 1},
                               {"parallel.cp_mode": "ring", "parallel.sequence_parallel": True}),
    "pack-tp2-sp-cp2-ring": (4, {"cp": 2, "tp": 2, "dp_replicate": 1},
                             {"parallel.cp_mode": "ring", "parallel.sequence_parallel": True,
                              "data.packing": "pack"}),
    "varlen-tp2-sp-cp2-ulysses": (4, {"cp": 2, "tp": 2, "dp_replicate": 1},
                                  {"parallel.cp_mode": "ulysses",
                                   "parallel.sequence_parallel": True}),
    # a pipeline carries each microbatch's cp shard, of its own length, between stages
    "varlen-pp2-cp2": (4, {"pp": 2, "cp": 2, "dp_replicate": 1},
                       {"parallel.cp_mode": "ring", "parallel.schedule": "1f1b"}),
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[str, dict]:
    """Short documents of very different lengths (``tests/dist/test_varlen_parity.py``'s)."""
    data_dir, overrides = prepared_documents(tmp_path_factory, "cp_docs", SEQ_LEN, count=300,
                                             seed=23)
    overrides.update({"data.packing": "varlen", "data.tokens_per_microbatch": BUDGET, "train.global_batch_tokens": 4 * BUDGET, "model.preset": "tiny", "model.n_layers": 2, "train.steps": STEPS})
    return data_dir, overrides


def _pack(base: dict) -> dict:
    """The same corpus as packed rows: 4 rows of 32 per step, 2 per microbatch."""
    pack = {k: v for k, v in base.items()
            if k not in ("data.tokens_per_microbatch", "train.global_batch_tokens")}
    return {**pack, "data.packing": "pack", "train.global_batch_size": 4,
            "train.micro_batch_size": 2}


_references: dict[str, dict] = {}


# matrix: tp2 x cp2 without SP and varlen ring under SP (tp2 x SP x cp2 runs with Ulysses on
# varlen documents and with the ring on packed rows)
@pytest.mark.parametrize("layout", matrix(TRAINER_LAYOUTS, ci=[
    name for name in TRAINER_LAYOUTS if name not in ("varlen-tp2-cp2", "varlen-tp2-sp-cp2-ring")]))
def test_the_trainer_with_documents_under_cp_matches_one_process(dist, short_documents, layout):
    data_dir, base = short_documents
    world, degrees, extra = TRAINER_LAYOUTS[layout]
    packing = extra.get("data.packing", "varlen")
    if packing == "pack":
        base = _pack(base)
    if packing not in _references:
        _references[packing] = dist.run(1, record_training, layout_config(base, 1), data_dir,
                                         STEPS)[0]
    reference = _references[packing]
    config = layout_config({**base, **extra}, world, **degrees)
    for rank, got in enumerate(dist.run(world, record_training, config, data_dir, STEPS)):
        where = f"{layout} rank {rank}"
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
    assert reference["loss"][-1] != reference["loss"][0]


# -- the config ---------------------------------------------------------------------------------
def _config(overrides: dict, world: int):
    return resolve(load_config(None, {"model.preset": "tiny", "data.seq_len": "32",
                                      **overrides}), world)


@pytest.mark.parametrize("packing", ["pack", "varlen"])
@pytest.mark.parametrize("mode", ["ring", "ulysses", "hybrid", "allgather"])
def test_documents_are_accepted_in_every_cp_mode(packing, mode):
    config = _config({"data.packing": packing, "parallel.cp": "4", "parallel.cp_mode": mode}, 4)
    assert config.parallel.cp == 4 and config.data.packing == packing


