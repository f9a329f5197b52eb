"""``data.balance = zeppelin`` over the data-parallel ranks (``loom.parallel.zeppelin_cp``): each
step's merged varlen microbatches placed over every dp x cp rank, trained exactly.

The corpus mixes short documents (20 to 200 bytes) with long ones (600 to 800 bytes, cut into
pieces of up to 512 predictions), and the model is the ``debug`` shape (dim 64), whose
attention weighs enough beside its linear work that a 512-token piece holds more work than a
rank's share of a merged microbatch (two 640-token bins over dp = 2, or over dp = 2 x cp = 2):
the placement cuts it over a sub-ring that spans dp ranks, beside short ones kept whole on
single ranks.

* Merging: merged microbatch i is every dp rank's i-th microbatch (``data.balance = tokens``'
  bins), concatenated in dp order: the same tokens, targets and positions, document ids still
  run ordinals.
* The ``Trainer`` (2 AdamW steps: loss, gradient norm, every gradient) with dp = 2 (cp = 1:
  pure data parallelism), dp = 2 x cp = 2 (matrix: dp_shard = 2 x cp = 2, FSDP; dp = 4)
  equals one process running the same bins (``tokens``) with per-document attention; so does
  its evaluation loss (dp = 2). In each run every rank gets the same merged microbatch, the
  domain's ranks hold each of its tokens exactly once between them (ranks holding unequal
  token counts), some document is cut over ranks of different dp coordinates (each of them
  sends ring hops: the cross-dp sub-ring ran) and some is kept whole.
* The remapping layer (``data.zeppelin_remap``; CI: dp = 2; matrix: dp = 2 x cp = 2, cp = 2,
  cp = 4): the same parity, each rank's shard the remapped placement's linear layout (an
  equal split, counts within one), a document longer than a rank's share among the
  microbatches, the attention layout cutting some document over a group (its ring sent hops)
  and keeping some whole, and the all-to-alls counted on every rank (ledger axis ``remap``).
  The config refuses it without zeppelin, or with tp or pp > 1.
* The config accepts zeppelin with dp > 1 and cp = 1, dp_replicate or dp_shard, and refuses by
  name what the dp x cp domain does not run yet: tp, pp or ep > 1, an outer dp mode, MoE.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loom.config import from_dict, load_config, resolve
from loom.config_rules.data import zeppelin_over_dp
from loom.data.packing import DocumentBatch
from loom.data.varlen import VarlenBatch
from loom.errors import ConfigError
from loom.parallel.zeppelin_placement import merge_dp_microbatches
from loom.testing.parity import assert_parity, layout_config, record_training, train_and_record
from loom.train.trainer import Trainer
from tests.conftest import matrix
from tests.data_fixtures import prepared_documents
from tests.dist.test_zeppelin_cp import (check_evaluation, zeppelin_config,
                                         assert_linear_layout, record_placements,
                                         record_remapped_training)

STEPS = 2
SEQ_LEN, BUDGET = 1024, 1152  # split length, tokens per microbatch (a dp rank's bin)
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = {  # name: (world, degrees)
    "dp2": (2, {"dp_replicate": 2}),
    "dp2-cp2": (4, {"dp_replicate": 2, "cp": 2}),
    "dpshard2-cp2": (4, {"dp_replicate": 1, "dp_shard": 2, "cp": 2}),
    "dp4": (4, {"dp_replicate": 4}),
}
CI_LAYOUTS = ["dp2", "dp2-cp2"]


def write_long_tail(directory: Path, count: int, seed: int) -> None:
    """``count`` text files: one in twelve 600 to 800 bytes, the others 20 to 200 (log-uniform)."""
    rng = random.Random(seed)
    for i in range(count):
        length = rng.randint(1100, 1400) if i % 12 == 3 else int(20 * 10 ** rng.random())
        text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(length))
        (directory / f"doc{i:04d}.txt").write_text(text)


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory) -> tuple[str, dict]:
    data_dir, overrides = prepared_documents(tmp_path_factory, "zeppelin_dp_docs", SEQ_LEN,
                                             count=240, seed=7, write=write_long_tail)
    overrides.update({"data.packing": "varlen", "data.tokens_per_microbatch": BUDGET,
                      "model.preset": "debug", "model.max_seq_len": SEQ_LEN, "model.n_layers": 2,
                      "train.steps": STEPS})
    return data_dir, overrides


def _microbatch(ids: list[int], start: int) -> DocumentBatch:
    ids_t = torch.tensor([ids])
    n = ids_t.shape[1]
    return DocumentBatch(torch.arange(start, start + n)[None], torch.arange(start, start + n)[None]
                         + 1000, torch.arange(n)[None], ids_t)


def test_merged_microbatch_i_is_every_dp_ranks_ith_in_dp_order():
    # dp = 2, two microbatches each: rank 0 holds bins 0, 1 and rank 1 bins 2, 3
    bins = [_microbatch([0, 0, 1], 0), _microbatch([0], 10), _microbatch([0, 1, 1], 20),
            _microbatch([0, 0], 30)]
    merged = merge_dp_microbatches(VarlenBatch(tuple(bins), 9), 2)
    assert len(merged.microbatches) == 2 and merged.step_tokens == 9
    first, second = merged.microbatches
    assert first.inputs[0].tolist() == [0, 1, 2, 20, 21, 22]  # bins 0 and 2
    assert second.inputs[0].tolist() == [10, 30, 31]  # bins 1 and 3
    assert first.targets[0].tolist() == [t + 1000 for t in first.inputs[0].tolist()]
    assert first.positions[0].tolist() == [0, 1, 2, 0, 1, 2]
    # run ordinals: bin 2's first document stays apart from bin 0's last, and bin 3's one
    # document from bin 1's one
    assert first.document_ids[0].tolist() == [0, 0, 1, 2, 3, 3]
    assert second.document_ids[0].tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="cannot be merged"):
        merge_dp_microbatches(VarlenBatch(tuple(bins[:3]), 7), 2)


def record_domain_training(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``train_and_record``, plus this rank's place in the dp x cp domain and its dp
    coordinate, each microbatch's merged row and this rank's shard of it as (document id,
    position) pairs, and the bytes it sent in ring hops (the ``cp`` axis of the ledger)."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    placed = record_placements(trainer)
    record = train_and_record(trainer, steps)
    record.update(placed=placed, domain_rank=trainer.cp_groups.cp_rank,
                  domain=trainer.cp_groups.layout.ring, dp_rank=trainer.dp_rank,
                  ring_sent=trainer.ledger.get("cp", "send").payload_bytes)
    return record


def assert_placed_over_the_domain(ranks: list[dict], dp: int, cp: int) -> None:
    """Every rank gets the same merged row; the domain's D x C ranks (cp index innermost) hold
    each of its tokens exactly once; some document is cut over ranks of different dp
    coordinates (each of them sent ring hops) and some kept whole."""
    assert sorted(got["domain_rank"] for got in ranks) == list(range(dp * cp))
    by_place = {got["domain_rank"]: got for got in ranks}
    for place, got in by_place.items():
        assert got["domain"] == dp * cp and got["dp_rank"] == place // cp
    rows = [[row for row, _ in got["placed"]] for got in ranks]
    assert all(r == rows[0] for r in rows)
    across_dp = whole = 0
    uneven = False
    in_cross_rings: set[int] = set()
    for mb, row in enumerate(rows[0]):
        shards = [by_place[p]["placed"][mb][1] for p in range(dp * cp)]
        held = [pair for shard in shards for pair in shard if pair[0] >= 0]
        assert sorted(held) == sorted(row)  # every token once (no padding in a varlen row)
        counts = [sum(pair[0] >= 0 for pair in shard) for shard in shards]
        uneven |= len(set(counts)) > 1
        holders: dict[int, set[int]] = {}
        for p, shard in enumerate(shards):
            for doc, _ in shard:
                if doc >= 0:
                    holders.setdefault(doc, set()).add(p)
        for places in holders.values():
            if len({p // cp for p in places}) > 1:
                across_dp += 1
                in_cross_rings |= places
            whole += len(places) == 1
    assert across_dp and whole and uneven, (across_dp, whole, uneven)
    assert all(by_place[p]["ring_sent"] > 0 for p in in_cross_rings)


_reference: dict[int, dict] = {}


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=CI_LAYOUTS))
def test_zeppelin_over_dp_matches_one_process(dist, long_tail, layout):
    data_dir, base = long_tail
    world, degrees = LAYOUTS[layout]
    dp = world // degrees.get("cp", 1)
    base = {**base, "train.global_batch_tokens": dp * BUDGET}  # one bin per dp rank
    if dp not in _reference:  # the same bins: tokens' deal, every document whole
        _reference[dp] = dist.run(1, record_training,
                                  layout_config({**base, "data.balance": "tokens"}, 1),
                                  data_dir, STEPS)[0]
    reference = _reference[dp]
    config = layout_config({**base, "data.balance": "zeppelin", "parallel.cp_mode": "ring",
                            "metrics.comm": True}, world, **degrees)
    ranks = dist.run(world, record_domain_training, config, data_dir, STEPS)
    for rank, got in enumerate(ranks):
        where = f"zeppelin {layout} rank {rank}"
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
    assert_placed_over_the_domain(ranks, dp, degrees.get("cp", 1))
    assert reference["loss"][-1] != reference["loss"][0]


def test_evaluation_over_dp_matches_one_process(dist, long_tail, tmp_path):
    _, base = long_tail
    check_evaluation(dist, {**base, "train.global_batch_tokens": 2 * BUDGET}, SEQ_LEN,
                     tmp_path, 2, dp_replicate=2)


def test_zeppelin_is_accepted_over_dp_with_or_without_cp():
    assert zeppelin_config({"parallel.dp_replicate": "2"}, 2).parallel.cp == 1
    assert zeppelin_config({"parallel.dp_shard": "2", "parallel.cp": "2"}, 4).parallel.dp == 2


@pytest.mark.parametrize("overrides, world, blocker", [
    ({"parallel.dp_replicate": "2", "parallel.tp": "2"}, 4, "parallel.tp = 2"),
    ({"parallel.dp_replicate": "2", "parallel.pp": "2"}, 4, "parallel.pp = 2"),
    ({"parallel.dp_replicate": "2", "parallel.dp_mode": "diloco"}, 2, "parallel.dp_mode"),
    ({"parallel.dp_replicate": "2", "model.n_experts": "4"}, 2, "an MoE model"),
])
def test_zeppelin_at_cp_1_refuses_what_the_dp_domain_is_not_built_for(overrides, world, blocker):
    with pytest.raises(ConfigError, match="dp x cp domain is out") as info:
        zeppelin_config(overrides, world)
    assert info.value.field_name == "data.balance" and blocker in str(info.value)


def test_with_cp_what_the_dp_domain_is_not_built_for_places_over_each_cp_group():
    """dp x tp x cp ran before the dp x cp domain existed, placing over each dp rank's cp
    ranks; it still does (the trainer asks ``zeppelin_over_dp``)."""
    config = zeppelin_config({"parallel.dp_replicate": "2", "parallel.tp": "2",
                              "parallel.cp": "2"}, 8)
    assert zeppelin_over_dp(config) == ("parallel.tp = 2 (the dp x cp domain is not built with"
                                        " it yet)")
    assert zeppelin_over_dp(zeppelin_config({"parallel.dp_replicate": "2"}, 2)) is None

# -- the remapping layer (data.zeppelin_remap) -------------------------------------------------
REMAP_LAYOUTS = {"dp2": LAYOUTS["dp2"], "dp2-cp2": LAYOUTS["dp2-cp2"],
                 "cp2": (2, {"dp_replicate": 1, "cp": 2}), "cp4": (4, {"dp_replicate": 1, "cp": 4})}
REMAP_CI = ["dp2"]


@pytest.mark.parametrize("layout", matrix(REMAP_LAYOUTS, ci=REMAP_CI))
def test_remapped_zeppelin_over_dp_matches_one_process(dist, long_tail, layout):
    """The linear modules on an equal split, attention on Zeppelin's layout: loss, norm and
    every gradient as one process running the same bins; the all-to-alls ran on every rank
    and the grouped documents' rings sent hops."""
    data_dir, base = long_tail
    world, degrees = REMAP_LAYOUTS[layout]
    cp = degrees.get("cp", 1)
    # two bins a step: merged into one microbatch over dp = 2, two microbatches at dp = 1
    base = {**base, "train.global_batch_tokens": 2 * BUDGET}
    if 2 not in _reference:
        _reference[2] = dist.run(1, record_training,
                                 layout_config({**base, "data.balance": "tokens"}, 1),
                                 data_dir, STEPS)[0]
    reference = _reference[2]
    config = layout_config({**base, "data.balance": "zeppelin", "data.zeppelin_remap": True,
                            "parallel.cp_mode": "ring", "metrics.comm": True}, world, **degrees)
    ranks = dist.run(world, record_remapped_training, config, data_dir, STEPS)
    for rank, got in enumerate(ranks):
        where = f"zeppelin remapped {layout} rank {rank}"
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
        assert got["remap_calls"] > 0
    assert sum(got["remap_wire"] for got in ranks) > 0  # some token moved
    assert_linear_layout(ranks, world, cp)
    assert any(got["ring_sent"] > 0 for got in ranks)


def test_remapping_needs_zeppelin_and_refuses_tp_or_pp_by_name():
    with pytest.raises(ConfigError) as info:
        resolve(load_config(None, {"model.preset": "tiny", "data.seq_len": "32",
                                   "data.packing": "varlen", "data.balance": "tokens",
                                   "data.zeppelin_remap": "true"}), 1)
    assert info.value.field_name == "data.zeppelin_remap" and "data.balance" in str(info.value)
    with pytest.raises(ConfigError, match="parallel.tp = 2") as info:
        zeppelin_config({"parallel.cp": "2", "parallel.tp": "2", "data.zeppelin_remap": "true"}, 4)
    assert info.value.field_name == "data.zeppelin_remap"
    assert zeppelin_config({"parallel.dp_replicate": "2", "data.zeppelin_remap": "true"},
                   2).data.zeppelin_remap
