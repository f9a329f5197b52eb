"""Specification of ``data.packing = "varlen"`` (``loom.data.varlen``): pieces that hold every
prediction once, steps of token-budget microbatches that do not depend on the layout, the
``tokens`` balance, microbatches with no padding and positions restarting at every piece, a
resumable loader, mixed sources (``data.mix``) whose weights are shares of tokens, and the
refusals that name the field at fault."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.config import ConfigError, job_of, layout_of, load_config, resolve
from loom.data.loader import GlobalBatchSampler, prepare_data
from loom.data.prepare import INDEX_DTYPE, INDEX_FILE, prepare
from loom.data.varlen import (
    MixedPieces,
    VarlenDocuments,
    VarlenLoader,
    balance_tokens,
    first_fit,
    plan_step,
    split_pieces,
    varlen_eval_batches,
)
from tests.data_fixtures import TEXTS, DataCfg, write_source

EOS = 999
SPLIT = 8


def _corpus(seed: int = 3, count: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and document offsets: lengths 1 to 30 (some longer than two pieces), every
    document's tokens distinct from its neighbours' (value = 10 * document + position % 10)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 31, size=count)
    tokens = np.concatenate([10 * d + np.arange(n) % 10 for d, n in enumerate(lengths)])
    return tokens.astype(np.int64), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def test_pieces_hold_every_prediction_once_and_in_order():
    lengths = [5, 1, 9, 17, 2, 8]
    pieces = split_pieces(lengths, SPLIT)
    assert pieces.length.max() <= SPLIT and pieces.length.min() >= 1
    for doc, n in enumerate(lengths):
        mine = pieces.document == doc
        assert pieces.length[mine].sum() == max(n - 1, 0)  # a 1-token document gives nothing
        assert list(pieces.offset[mine]) == list(range(0, max(n - 1, 0), SPLIT))
    assert list(pieces.length[pieces.document == 3]) == [8, 8]


def test_first_fit_takes_pieces_in_order_until_one_fits_no_bin():
    lengths = np.array([5, 6, 4, 3, 7, 2, 8, 1])
    taken, bins = first_fit(lengths, num_bins=3, budget=9)
    # 4 goes back to bin 0, 2 to bin 2 after 7; 8 fits none (every bin full): the step ends
    assert taken == 6 and list(bins) == [0, 1, 0, 1, 2, 2]
    assert first_fit(np.array([1, 1]), num_bins=3, budget=9)[0] == 2  # all fitted: may take more


def test_token_balance_deals_longest_first_to_the_emptiest_bin():
    lengths = np.array([2, 7, 3, 5, 6, 1])
    bins = balance_tokens(lengths, num_bins=2, budget=20)
    loads = np.bincount(bins, weights=lengths, minlength=2)
    assert list(loads) == [12, 12]
    assert balance_tokens(np.array([5, 5, 5]), num_bins=2, budget=9) is None  # over budget


def test_steps_do_not_depend_on_the_layout_and_microbatches_have_no_padding():
    tokens, offsets = _corpus()
    data = VarlenDocuments(tokens, offsets, SPLIT)
    sampler = GlobalBatchSampler(len(data), 1, seed=5)
    steps = {}
    for dp in (1, 2, 4):
        loaders = [VarlenLoader(data, sampler, 48, 12, "none", rank, dp) for rank in range(dp)]
        steps[dp] = [[mb for loader in loaders for mb in loader.next_batch().microbatches]
                     for _ in range(3)]
        assert len({loader.consumed_samples for loader in loaders}) == 1
    for dp in (2, 4):  # the ranks' microbatches, in rank order, are one process's
        for mine, one in zip(steps[dp], steps[1]):
            assert len(mine) == len(one) == 4
            for a, b in zip(mine, one):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
    seen = []
    for mb in steps[1][0]:
        assert mb.inputs.shape[0] == 1 and 0 < mb.inputs.shape[1] <= 12
        ids, positions = mb.document_ids[0], mb.positions[0]
        starts = torch.cat([torch.tensor([True]), ids[1:] != ids[:-1]])
        assert torch.equal(positions == 0, starts)  # restarting at every piece, nowhere else
        # inputs then targets are consecutive tokens of one document: value + 1 (mod 10)
        same = ~starts[1:]
        assert torch.equal(mb.inputs[0, 1:][same], mb.targets[0, :-1][same])
        assert ((mb.targets[0] - mb.inputs[0]) % 10 == 1).all()
        seen.append(mb.inputs.shape[1])
    assert sum(seen) > 48 - 4 * SPLIT and len(set(seen)) > 1


def test_token_balance_evens_the_ranks_and_keeps_the_steps_documents():
    tokens, offsets = _corpus(seed=8, count=200)
    data = VarlenDocuments(tokens, offsets, SPLIT)
    order = GlobalBatchSampler(len(data), 1, seed=2).indices
    spread = {}
    for balance in ("none", "tokens"):
        plan, taken = plan_step(order, 0, data.lengths, 8, 16, balance)
        loads = np.bincount(plan.bins, weights=data.lengths[plan.pieces], minlength=8)
        assert loads.max() <= 16 and loads.min() > 0
        spread[balance] = (loads.max() - loads.min(), sorted(plan.pieces.tolist()), taken)
    assert spread["tokens"][1:] == spread["none"][1:]  # the same pieces, dealt differently
    assert spread["tokens"][0] <= spread["none"][0] and spread["tokens"][0] <= SPLIT


def test_the_loader_resumes_at_the_next_step():
    tokens, offsets = _corpus()
    data = VarlenDocuments(tokens, offsets, SPLIT)
    sampler = GlobalBatchSampler(len(data), 1, seed=1)
    first = VarlenLoader(data, sampler, 24, 12, "tokens")
    for _ in range(5):  # past an epoch boundary too
        first.next_batch()
    state = first.state_dict()
    expected = first.next_batch()
    assert first.last_step_tokens == sum(mb.inputs.shape[1] for mb in expected.microbatches)
    second = VarlenLoader(data, GlobalBatchSampler(len(data), 1, seed=1), 24, 12, "tokens",
                          dp_rank=1, dp_size=2)
    second.load_state_dict(state)
    (mine,) = second.next_batch().microbatches
    assert all(torch.equal(x, y) for x, y in zip(mine, expected.microbatches[1]))
    with pytest.raises(ValueError, match="seed"):
        VarlenLoader(data, GlobalBatchSampler(len(data), 1, seed=9), 24, 12).load_state_dict(
            state)


def test_evaluation_reads_the_split_in_order_in_whole_steps():
    tokens, offsets = _corpus()
    data = VarlenDocuments(tokens, offsets, SPLIT)
    steps = list(varlen_eval_batches(data, 24, 12))
    covered = sum(mb.inputs.shape[1] for step in steps for mb in step.microbatches)
    assert len(steps) > 2 and data.lengths.sum() - covered < 24
    assert len(list(varlen_eval_batches(data, 24, 12, max_batches=2))) == 2


def _varlen(overrides: dict, world: int = 1):
    return resolve(load_config(None, {"data.packing": "varlen", "model.preset": "debug",
                                      "data.seq_len": "32", **overrides}), world)


@pytest.mark.parametrize("overrides, world, field, words", [
    ({"data.tokens_per_microbatch": "16"}, 1, "data.tokens_per_microbatch", "split length"),
    ({"data.tokens_per_microbatch": "64", "train.global_batch_tokens": "192",
      "parallel.dp_replicate": "2"}, 2, "train.global_batch_tokens", "nearest valid: 128 or"),
    # unset, the step's tokens are derived, and the line says from what
    ({"data.tokens_per_microbatch": "96", "train.global_batch_size": "4",
      "parallel.dp_replicate": "2"}, 2, "train.global_batch_tokens",
     r"\(unset: train.global_batch_size 4 x data.seq_len 32\) must be divisible"),
])
def test_varlen_refuses_by_name(overrides, world, field, words):
    with pytest.raises(ConfigError, match=words) as info:
        _varlen(overrides, world)
    assert info.value.field_name == field


@pytest.mark.parametrize("overrides, world", [  # tests/dist/test_documents_axes.py runs them
    ({"train.recompute": "selective"}, 1),
    ({"parallel.tp": "2", "parallel.sequence_parallel": "true"}, 2),
    ({"parallel.tp": "2", "parallel.sequence_parallel": "true", "parallel.pp": "2"}, 4),
    ({"model.preset": "tiny-moe"}, 1),
    ({"model.preset": "tiny-moe", "parallel.ep": "2", "parallel.dp_replicate": "1"}, 2),
])
def test_varlen_runs_on_tp_sp_moe_and_selective_recompute(overrides, world):
    assert _varlen(overrides, world).data.packing == "varlen"


@pytest.mark.parametrize("overrides, field", [
    ({"data.tokens_per_microbatch": "64"}, "data.tokens_per_microbatch"),
    ({"train.global_batch_tokens": "512"}, "train.global_batch_tokens"),
    ({"data.balance": "tokens"}, "data.balance"),
])
def test_varlen_fields_are_refused_without_varlen(overrides, field):
    with pytest.raises(ConfigError, match="varlen") as info:
        resolve(load_config(None, {"model.preset": "debug", **overrides}), 1)
    assert info.value.field_name == field


def test_varlen_layout_counts_microbatches_in_tokens():
    config = _varlen({"train.global_batch_tokens": "512", "data.tokens_per_microbatch": "64",
                      "parallel.pp": "2", "parallel.dp_replicate": "2"}, 4)
    layout = layout_of(config)
    assert layout.microbatches == 4 and layout.micro_batch == 2  # 64 tokens: two rows of 32
    default = layout_of(_varlen({}))  # 0: the sequences' tokens, as concat would train
    assert default.microbatches == 16 // 4


def test_varlen_refuses_a_doc_index_that_does_not_match_its_token_file(tmp_path):
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:6])
    prepare(str(corpus), "byte", tmp_path / "prepared", progress=False)
    files = prepare_data(DataCfg(source=str(tmp_path / "prepared"), val_fraction=0.2),
                         tmp_path / "run")
    assert len(files.train_set(16, packing="varlen")) > 0
    index = tmp_path / "prepared" / INDEX_FILE
    offsets = np.fromfile(index, dtype=INDEX_DTYPE)
    offsets[-1] += 1  # same size, a total the token file does not have
    offsets.tofile(index)
    with pytest.raises(ConfigError, match="does not match") as info:
        files.train_set(16, packing="varlen")
    assert info.value.field_name == "data.source"


def test_moe_documents_are_accepted_with_zeppelin_under_cp_and_over_the_dp_domain():
    """An MoE model's documents split over ranks sum their counts over the parts (loom.models
    .moe), on the static cp shards, on Zeppelin's cp placement and on its dp x cp domain alike
    (tests/dist/test_zeppelin_cp.py, test_zeppelin_dp.py)."""
    base = {"model.preset": "tiny-moe", "data.packing": "varlen", "parallel.cp": "2",
            "data.tokens_per_microbatch": "512", "train.global_batch_tokens": "2048"}
    config = resolve(load_config(None, base), 2)
    assert config.parallel.cp == 2 and config.model.n_experts > 0
    zeppelin = resolve(load_config(None, {**base, "data.balance": "zeppelin"}), 2)
    assert zeppelin.data.balance == "zeppelin" and zeppelin.model.n_experts > 0
    over_dp = resolve(load_config(None, {**base, "data.balance": "zeppelin", "parallel.cp": "1",
                                         "parallel.dp_replicate": "2"}), 2)
    assert over_dp.parallel.dp == 2 and over_dp.model.n_experts > 0


# -- mixed sources (data.mix) ------------------------------------------------------------------
def test_mixed_pieces_are_one_index_space_of_the_sources_pieces():
    a = VarlenDocuments(*_corpus(seed=3), SPLIT, name="a")
    b = VarlenDocuments(*_corpus(seed=4, count=20), SPLIT, name="b")
    mixed = MixedPieces([a, b])
    assert len(mixed) == len(a) + len(b)
    assert mixed.lengths.tolist() == a.lengths.tolist() + b.lengths.tolist()
    row = mixed.microbatch([2, len(a) + 5, 0])  # pieces of both sources in one row
    parts = [a.microbatch([2]), b.microbatch([5]), a.microbatch([0])]
    assert torch.equal(row.inputs, torch.cat([p.inputs for p in parts], dim=1))
    assert torch.equal(row.targets, torch.cat([p.targets for p in parts], dim=1))
    assert torch.equal(row.positions, torch.cat([p.positions for p in parts], dim=1))
    sizes = [len(p.inputs[0]) for p in parts]  # ordinals run over the row's pieces
    assert row.document_ids[0].tolist() == [i for i, n in enumerate(sizes) for _ in range(n)]
    reordered = MixedPieces([a, b], np.array([len(a) + 5, 2]))  # validation's mixture order
    assert len(reordered) == 2 and reordered.lengths.tolist() == [b.lengths[5], a.lengths[2]]
    assert torch.equal(reordered.microbatch([0, 1]).inputs,
                       torch.cat([parts[1].inputs, parts[0].inputs], dim=1))


def _two_sources(tmp_path, short_weight: float):
    """A run mixing a source of short documents (5 to 13 bytes of 'a') with one of long ones
    (150 to 230 bytes of 'b'), the short ones at ``short_weight``; varlen pieces of 32."""
    short = write_source(tmp_path / "short", "text", ["a" * (5 + i % 9) for i in range(400)])
    long = write_source(tmp_path / "long", "text", ["b" * (150 + 2 * i) for i in range(40)])
    files = prepare_data(DataCfg(mix=f"{short}:{short_weight},{long}:{1 - short_weight}",
                                 val_fraction=0.25), tmp_path / f"run{short_weight}")
    return files, files.train_set(32, packing="varlen")


@pytest.mark.parametrize("short_weight", [0.5, 0.2])
def test_mixed_varlen_weights_are_shares_of_the_tokens(tmp_path, short_weight):
    """A piece of the long source holds about 30 predictions, one of the short source about 8:
    weighted per piece, the short source would get far less than its share of the tokens."""
    files, train = _two_sources(tmp_path, short_weight)
    assert isinstance(train, MixedPieces) and len(train.parts) == 2
    loader = VarlenLoader(train, files.sampler(train, 1, seed=0), 256, 128, "tokens")
    counts = {ord("a"): 0, ord("b"): 0}
    for _ in range(60):
        for mb in loader.next_batch().microbatches:
            for token in (ord("a"), ord("b")):
                counts[token] += int((mb.targets == token).sum())
    share = counts[ord("a")] / (counts[ord("a")] + counts[ord("b")])
    assert share == pytest.approx(short_weight, abs=0.04), counts


def test_mixed_varlen_validation_and_resume(tmp_path):
    files, train = _two_sources(tmp_path, 0.5)
    val = files.val_set(32, packing="varlen")
    assert isinstance(val, MixedPieces) and val.order is not None
    assert len(set(val.order.tolist())) == len(val)  # each piece at most once
    assert {int(j >= val.starts[1]) for j in val.order.tolist()} == {0, 1}  # both sources
    assert len(list(varlen_eval_batches(val, 128, 64))) > 0

    def loader(rank: int, dp: int) -> VarlenLoader:
        return VarlenLoader(train, files.sampler(train, 1, seed=3), 256, 64, "tokens", rank, dp)

    reference = loader(0, 1)
    for _ in range(3):
        reference.next_batch()
    state = reference.state_dict()
    expected = reference.next_batch().microbatches
    resumed = [loader(r, 2) for r in range(2)]  # at another dp degree
    for lo in resumed:
        lo.load_state_dict(state)
    got = [mb for lo in resumed for mb in lo.next_batch().microbatches]
    assert len(got) == len(expected) == 4
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(got, expected))


def test_varlen_accepts_mixed_sources_and_compiled_blocks():
    config = _varlen({"data.mix": "stdlib:0.5,stdlib:0.5"})
    assert config.data.mix and config.data.packing == "varlen"
    compiled = _varlen({"train.compile": "true"})  # tests/dist/test_compile_parity.py
    assert compiled.train.compile and job_of(compiled).packing == "varlen"
    with pytest.raises(ConfigError, match="recursion limit") as info:  # not built with tp
        _varlen({"train.compile": "true", "parallel.tp": "2"}, 2)
    assert info.value.field_name == "train.compile"
