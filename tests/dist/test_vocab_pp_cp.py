"""Vocabulary parallelism across the pipeline under context parallelism is one process, split.

``parallel.vocab_parallel_pp`` puts rows [rV/p, (r+1)V/p) of the embedding and of the head on
pipeline rank r; ``parallel.cp`` gives each cp rank its own part of every sequence. The pieces
the split computes are per token: the embedding lookup, and the S pass's statistics (row max,
sum of exp, target logit) of each token's logits over the rows. So each cp coordinate's
pipeline (the pp ranks sharing it) runs the S and T passes and the partial embeddings of its own
tokens in its own pp group, the targets sharded with the tokens, and nothing of them crosses cp.
What cp adds is the rows' reduction: every cp rank holds the same rows and computes their
gradient from other tokens, so they are averaged over dp x cp like every stage's parameters
(``vocab_pipeline.data_parallel_rows``: ``dp_cp``, or ZeRO's dp_shard x cp), and the loss is
the mean of the cp ranks' local token means (equal shares, concatenated rows), as the
trainer's ``loss_fn / n_micro`` and the reducer's average make it for any model under cp.

At pp = 2 x cp = 2 (4 ranks), three AdamW steps with clipping (``train.grad_clip`` = 1, below
the reference's gradient norm at every step, so the clip scales every step: a row counted twice
or missed would show in the norm and in every later weight) give one process's loss, gradient
norm and every gradient, then its validation loss and saved weights. CI: 1F1B with the ring.
Matrix (``-m matrix``): ZB-V (split backwards) with Ulysses, 1F1B with all-gather attention,
ZB-V tied with the ring, and at 8 ranks pp = 2 x cp = 4 hybrid (2 Ulysses x 2 ring), ZeRO-1
and ZeRO-3 on dp_shard = 2 (the rows' buckets, or FSDP2's shards, over dp_shard x cp), tp = 2
without and with SP (the rows split over pp x tp, the statistics gathered over tp within each
cp coordinate). Every rank reports its rows reduced over dp x cp (the reducer's ledger axis
and group size) and the cp ranks all took part.

The traffic proves the "no exchange over cp": at pp = 2 x cp = 2 the pp messages are exactly
test_pipeline_vocab.py's volume at b·S/cp tokens, the cp records are those of the same layout
without the split, and the rows' gradients join the stages' one dp x cp all-reduce. And the
checkpoints: the cp ranks' rows are replicas, so a pp = 2 x cp = 2 run resumes bit-exactly and
its checkpoint loads bit-identically into one process and into vocab-pp without cp.

Tolerances are test_pipeline_parity.py's (fp32): step 1 rtol 1e-5 / atol 1e-6, later steps
rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import pytest

from loom.testing.parity import layout_config
from tests.conftest import matrix
from tests.dist.test_pipeline_parity import (BASE, STEPS, check, record_pipeline,
                                           tied_reference_runs)

VOCAB = {**BASE, "parallel.vocab_parallel_pp": True}
MICRO = 4  # microbatches per pipeline
CASES = [  # (schedule, cp, cp_mode, tied, ZeRO stage on dp_shard = 2 (0: dp_shard = 1), tp, SP)
    ("1f1b", 2, "ring", False, 0, 1, False),
    ("1f1b", 2, "allgather", False, 0, 1, False),
    ("zbv", 2, "ring", True, 0, 1, False),
    ("zbv", 2, "ulysses", False, 0, 1, False),
    ("1f1b", 4, "hybrid", False, 0, 1, False),  # 2 Ulysses x 2 ring
    ("1f1b", 2, "ring", False, 1, 1, False),
    ("1f1b", 2, "ring", False, 3, 1, False),
    ("1f1b", 2, "ring", False, 0, 2, False),
    ("1f1b", 2, "ring", False, 0, 2, True),
]


@pytest.fixture(scope="module")
def references(dist, small_data_dir, tmp_path_factory):
    """One-process runs by (global batch, tied), computed on first use."""
    return tied_reference_runs(dist, small_data_dir, tmp_path_factory, BASE, STEPS)


def rows_reduction(trainer) -> dict:
    """This rank's vocabulary rows and how they are reduced: the rows' shape, the reducer's kind,
    ledger axis and group size (its shard group under ZeRO), and this rank's cp coordinate."""
    reducer = trainer.pipeline.vocab_reducer
    kind = type(reducer).__name__
    if kind == "GatheredRows":  # at rest a DTensor sharded over FSDP2's (flattened) mesh
        mesh = trainer.pipeline.vocab.output.weight.device_mesh
        axis, group = mesh.mesh_dim_names[-1], mesh.size()
    else:
        axis, group = reducer.axis, reducer.size if kind == "GradientReducer" else reducer.d
    return {"rows": tuple(trainer.pipeline.vocab.output.weight.shape),
            "reducer": (kind, axis, group),
            "cp_rank": trainer.cp_groups.cp_rank}


@pytest.mark.parametrize("schedule, cp, mode, tied, stage, tp, sp", matrix(CASES, ci=[
    ("1f1b", 2, "ring", False, 0, 1, False)]),
    ids=[f"{s}-cp{c}-{m}{'-tied' if t else ''}{f'-zero{z}-dp_shard2' if z else ''}"
         f"{f'-tp{p}' if p > 1 else ''}{'-sp' if q else ''}" for s, c, m, t, z, p, q in CASES])
def test_vocab_parallel_pipeline_with_cp_matches_one_process(dist, small_data_dir, references,
                                                             tmp_path, schedule, cp, mode, tied,
                                                             stage, tp, sp):
    pp, shard = 2, 2 if stage else 1
    world, batch = pp * cp * shard * tp, MICRO * shard
    zero = {"zero_stage": stage} if stage else {}
    config = layout_config({**VOCAB, "train.global_batch_size": batch,
                            "parallel.schedule": schedule, "parallel.cp_mode": mode,
                            "model.tie_embeddings": tied, "parallel.sequence_parallel": sp},
                           world, pp=pp, cp=cp, dp_shard=shard, tp=tp, **zero)
    results = dist.run(world, record_pipeline, config, small_data_dir, STEPS, str(tmp_path),
                       rows_reduction)
    reference = references(batch, tied)
    # the clip bites on every step: the norm it scales by is the one under test
    assert min(reference["grad_norm"]) > BASE["train.grad_clip"], reference["grad_norm"]
    check(reference, results, f"vocab {schedule} pp={pp} cp={cp} ({mode}) dp_shard={shard}"
                              f" tp={tp}")
    vocab, dim = config["model"]["vocab_size"], config["model"]["dim"]
    kind = {0: ("GradientReducer", "dp_cp"), 1: ("ZeroShardedOptimizer", "dp_shard_cp"),
            3: ("GatheredRows", "dp_shard_cp")}[stage]
    cp_ranks = set()
    for result in results:
        observed = result["observed"]
        cp_ranks.add(observed[0]["cp_rank"])
        for record in observed:  # reduced over every cp rank (and dp_shard's), as a stage is
            assert {k: v for k, v in record.items() if k != "cp_rank"} == {
                "rows": (vocab // pp, dim), "reducer": (*kind, cp * shard)}
    assert cp_ranks == set(range(cp))



def ledger_by_axis(trainer) -> dict:
    """This step's ledger entries by (axis, op): (calls, payload, wire bytes); this rank's
    pipeline rank and parameter elements (the stages' and the vocabulary rows'); then the
    ledger is reset for the next step."""
    out = {f"{axis}/{op}": (r.calls, r.payload_bytes, r.wire_bytes)
           for (axis, op), r in trainer.ledger.records.items()}
    out["pp_rank"] = trainer.pipeline.pp_rank
    out["params"] = sum(p.numel() for p in trainer.model.parameters())
    trainer.ledger.reset()
    return out


def test_the_passes_stay_in_each_cp_coordinates_pipeline(dist, small_data_dir, tmp_path):
    """pp = 2 x cp = 2, ring, 1F1B, counted per step: (1) over pp, test_pipeline_vocab.py's
    volume of the split's messages at N = b·S/cp tokens (each cp coordinate's pp group carries
    its own tokens' embeddings, X, statistics and dX); (2) over cp, the very records of the
    same layout without the split (the ring attention's: the passes add nothing over cp);
    (3) over dp x cp, one all-reduce of every parameter of the rank, the rows included, plus
    the loss's scalar (4 bytes each, fp32): no other axis is touched."""
    micro, pp, cp = 4, 2, 2
    runs = {}
    for split in (True, False):
        config = layout_config({**VOCAB, "parallel.vocab_parallel_pp": split,
                                "train.global_batch_size": micro, "train.steps": 2,
                                "metrics.comm": True, "parallel.schedule": "1f1b"},
                               pp * cp, pp=pp, cp=cp)
        runs[split] = dist.run(pp * cp, record_pipeline, config, small_data_dir, 2,
                               str(tmp_path), ledger_by_axis)
    tokens = config["data"]["seq_len"] // cp  # micro batch 1
    big, stats = tokens * config["model"]["dim"] * 4, 3 * tokens * 4
    for split, plain in zip(runs[True], runs[False]):
        for step, (records, without) in enumerate(zip(split["observed"], plain["observed"])):
            r = records["pp_rank"]
            where = f"pp rank {r} step {step + 1}: {records}"
            first, last = r == 0, r == pp - 1
            boundary = 1  # pp = 2: the activation to rank 1 or the gradient to rank 0
            sends_big = boundary + (not first) + last * (pp - 1) + (not last) + first * (pp - 1)
            recvs_big = boundary + first * (pp - 1) + (not last) + last * (pp - 1) + (not first)
            n_stats = pp - 1
            assert records["pp/send"] == (micro * (sends_big + n_stats),
                                          micro * (sends_big * big + n_stats * stats),
                                          micro * (sends_big * big + n_stats * stats)), where
            assert records["pp/recv"] == (micro * (recvs_big + n_stats),
                                          micro * (recvs_big * big + n_stats * stats), 0.0), where
            assert records["pp/all_reduce"] == (1, 4, 4.0), where  # the loss to every pp rank
            ring = {k: v for k, v in records.items() if k.startswith("cp/")}
            assert ring and ring == {k: v for k, v in without.items() if k.startswith("cp/")}, \
                where
            assert records["dp_cp/all_reduce"][1] == 4 * records["params"] + 4, where
            assert {k.split("/")[0] for k in records if "/" in k} == {"pp", "cp", "dp_cp"}, where


def test_a_checkpoint_under_cp_holds_the_whole_rows_resumes_and_reshards(dist, small_data_dir,
                                                                         tmp_path):
    """The cp ranks hold the same rows (replicas, as dp_replicate's): at pp = 2 x cp = 2 a run
    stopped after 2 of 4 steps and resumed ends bit-identical to one that never stopped, and
    its checkpoint loads into one process and into vocab-pp at pp = 2 without cp with every
    weight and optimizer tensor bit-identical (test_vocab_pp_checkpoint.py's helpers)."""
    from tests.dist.test_checkpoint_resume import check_reshard, check_resume
    from tests.dist.test_vocab_pp_checkpoint import BASE as CKPT, VOCAB as ON, layout

    source = (4, layout_config({**CKPT, **ON}, 4, pp=2, cp=2, schedule="1f1b"))
    check_resume(dist, small_data_dir, tmp_path / "resume", *source, "vocab-pp2 x cp2")
    for target in ("single", "vocab-pp2"):
        check_reshard(dist, small_data_dir, tmp_path / target, source, layout(target),
                      f"vocab-pp2 x cp2 -> {target}")
