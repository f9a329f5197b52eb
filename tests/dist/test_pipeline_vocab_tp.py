"""Vocabulary parallelism across the pipeline composed with tensor parallelism is one process.

``parallel.vocab_parallel_pp = true`` with ``parallel.tp = t``: pipeline rank r, tp rank u holds
rows [(r t + u) V/(p t), (r t + u + 1) V/(p t)) of the embedding and the output layer
(``loom.parallel.vocab_pipeline``), the stages' blocks are Megatron-split over tp. For
pp = 2 x tp = 2, the paper's 1F1B variant and ZB-V (the V placement, split backwards), untied
and tied, and pp = 2 x tp = 2 x dp_replicate = 2, three optimizer steps give the same loss,
gradient norm and every parameter's gradient (the vocabulary rows gathered back over tp, then
pp) as one process with the same global batch; then the validation loss and the saved weights.
Tolerances and harness are tests/dist/test_pipeline_vocab.py's (fp32, debug preset, 8 layers):
here the softmax statistics combine in two levels (tp, then pp) and dX and the embedding are
sums over tp of sums over pp, only another summation order.

The memory it moves: no rank holds more than V/(p t) rows of either weight, and the p t ranks'
rows are disjoint and cover the vocabulary in the documented order. The tp traffic it adds is
counted in the ledger (axis ``tp_vocab``) and equals the volume the module docstring states.

Then the state: a pp2 x tp2 checkpoint holds every row (and Adam moment) at its offset, so one
process (tied too) and vocab-pp4 load it bit-identically, one process's loads into pp2 x tp2,
and a stopped run resumes bit-exactly; pretrained weights load into each rank's rows bit for
bit. And bf16 (fp32 masters) and bf16 autocast against one process in the same mode, with
tests/dist/test_vocab_pp_bf16.py's bounds. With sequence parallelism (1F1B, untied and tied;
ZB-V's split backwards under SP: tests/dist/test_pipeline_split_sp.py) the same parity,
and its tp collectives counted exactly too.
"""

from __future__ import annotations

import pytest

from loom.testing.parity import layout_config
from tests.conftest import matrix
from tests.dist.test_pipeline_parity import STEPS, check, record_pipeline
from tests.dist.test_pipeline_vocab import VOCAB, references  # noqa: F401  (the fixture)

CASES = [  # (schedule, microbatches per pipeline, tied, dp_replicate)
    ("1f1b", 4, False, 1),
    ("1f1b", 4, True, 1),
    ("zbv", 4, False, 1),
    ("zbv", 4, True, 1),
    ("1f1b", 4, False, 2),  # 8 ranks: the rows' gradients averaged over dp by their reducer
]


def vocab_shard(trainer) -> dict:
    """This rank's shard: the local shape of its rows (both weights), the first global row it
    holds, its pipeline and tp rank, and whether a stage holds vocabulary weights itself."""
    vocab = trainer.pipeline.vocab
    local = {name: tuple(getattr(vocab, name).weight.to_local().shape)
             for name in ("tok_embeddings", "output")}
    return {"local": local, "start": vocab.vocab_start, "pp": trainer.pipeline.pp_rank,
            "tp": trainer.grid.coords(trainer.ctx.rank)["tp"],
            "stage_vocab": [name for s in trainer.pipeline.stages.values()
                            for name, _ in s.module.named_parameters()
                            if name.startswith(("tok_embeddings", "output"))]}


@pytest.mark.parametrize("schedule, microbatches, tied, dp",
                         matrix(CASES, ci=[("1f1b", 4, True, 1)]),
                         ids=[f"{s}-m{m}{'-tied' if t else ''}{f'-dp{d}' if d > 1 else ''}"
                              for s, m, t, d in CASES])
def test_vocab_parallel_pipeline_with_tp_matches_one_process(dist, small_data_dir, references,
                                                             tmp_path, schedule, microbatches,
                                                             tied, dp):
    pp, tp = 2, 2
    config = layout_config({**VOCAB, "train.global_batch_size": microbatches * dp,
                            "parallel.schedule": schedule, "model.tie_embeddings": tied},
                           pp * tp * dp, pp=pp, tp=tp, dp_replicate=dp)
    results = dist.run(pp * tp * dp, record_pipeline, config, small_data_dir, STEPS,
                       str(tmp_path), vocab_shard)
    check(references(microbatches * dp, tied), results,
          f"vocab {schedule} pp={pp} tp={tp} dp={dp} m={microbatches}")
    vocab, dim = config["model"]["vocab_size"], config["model"]["dim"]
    rows = vocab // (pp * tp)
    for result in results:
        for observed in result["observed"]:
            # no rank holds more than V/(p t) rows; shard r t + u, pipeline-major
            assert observed["local"] == {"tok_embeddings": (rows, dim), "output": (rows, dim)}
            assert observed["start"] == (observed["pp"] * tp + observed["tp"]) * rows
            assert observed["stage_vocab"] == []


# Sequence parallelism (``parallel.sequence_parallel``): the stages' activations, and every
# vocabulary message over pp, are tp sequence shards; S all-gathers X over tp, T reduce-scatters
# its part of dX, the embedding is reduce-scattered before it travels and its gradient
# all-gathered after. The 1F1B variant, untied and tied (ZB-V's split backwards under SP:
# tests/dist/test_pipeline_split_sp.py).
SP_CASES = [("1f1b", False), ("1f1b", True)]


@pytest.mark.parametrize("schedule, tied", matrix(SP_CASES, ci=[("1f1b", True)]),
                         ids=[f"{s}{'-tied' if t else ''}" for s, t in SP_CASES])
def test_vocab_parallel_pipeline_with_sequence_parallel_matches_one_process(
        dist, small_data_dir, references, tmp_path, schedule, tied):
    pp, tp, microbatches = 2, 2, 4
    config = layout_config({**VOCAB, "train.global_batch_size": microbatches,
                            "parallel.schedule": schedule, "model.tie_embeddings": tied,
                            "parallel.sequence_parallel": True}, pp * tp, pp=pp, tp=tp)
    assert config["parallel"]["sequence_parallel"] is True
    results = dist.run(pp * tp, record_pipeline, config, small_data_dir, STEPS,
                       str(tmp_path), vocab_shard)
    check(references(microbatches, tied), results,
          f"vocab {schedule} pp={pp} tp={tp} sp m={microbatches}")


TRAFFIC = (4, 2, 2)  # microbatches per step, pp, tp of the traffic tests


def traffic_runs(dist, small_data_dir, tmp_path, sequence_parallel: bool):
    """Two training steps of vocab-pp at pp x tp (``TRAFFIC``, 1F1B) with every message
    recorded, and of the same at tp = 1 (the pp messages alone): (records, records at tp = 1,
    tokens per microbatch, model dim)."""
    from tests.dist.test_pipeline_comm import pp_records

    micro, pp, tp = TRAFFIC
    base = {**VOCAB, "train.global_batch_size": micro, "train.steps": 2, "metrics.comm": True,
            "parallel.schedule": "1f1b"}
    config = layout_config({**base, "parallel.sequence_parallel": sequence_parallel}, pp * tp,
                           pp=pp, tp=tp)
    results = dist.run(pp * tp, record_pipeline, config, small_data_dir, 2, str(tmp_path),
                       traffic_records)
    alone = dist.run(pp, record_pipeline, layout_config(base, pp, pp=pp), small_data_dir, 2,
                     str(tmp_path), pp_records)
    return results, alone, config["data"]["seq_len"], config["model"]["dim"]  # micro batch 1


def traffic_records(trainer) -> dict:
    """The step's ledger records: ``pp``'s (``pp_records``) and, under ``tp_vocab/``, those of
    the vocabulary shards' tp collectives; then the ledger is reset for the next step."""
    from tests.dist.test_pipeline_comm import pp_records

    ledger = trainer.ledger
    record = {op: ledger.get("tp_vocab", op)
              for op in ("all_gather", "all_reduce", "reduce_scatter")}
    tp = {f"tp_vocab/{op}": (r.calls, r.payload_bytes, r.wire_bytes)
          for op, r in record.items()}
    return {**tp, **pp_records(trainer)}


@pytest.mark.matrix  # the SP variant below runs in CI and counts the same messages and more
def test_vocab_tp_traffic_is_counted_and_equals_its_volume(dist, small_data_dir, tmp_path):
    """Per microbatch and training step, the pp traffic of each tp slice is exactly tp = 1's
    (tests/dist/test_pipeline_vocab.py checks that one against the runtime's docstring), and on
    top of it every rank all-gathers its [3, b s] fp32 statistics over tp in S; the first
    stage's ranks all-reduce the embedding (b s h fp32), the last stage's the summed dX.
    Counted exactly, on axis tp_vocab (t = 2: an all-gather's wire bytes are half its output,
    an all-reduce's equal its tensor)."""
    results, alone, tokens, dim = traffic_runs(dist, small_data_dir, tmp_path, False)
    micro, pp, tp = TRAFFIC
    big, gathered = tokens * dim * 4, tp * 3 * tokens * 4
    for result in results:
        for step, records in enumerate(result["observed"]):
            r = records["pp_rank"]
            where = f"pp rank {r} step {step + 1}: {records}"
            expected = alone[r]["observed"][step]
            assert (records["send"], records["recv"]) == (expected["send"], expected["recv"]), \
                f"{where} against tp = 1: {expected}"
            assert records["tp_vocab/all_gather"] == (micro, micro * gathered,
                                                      micro * gathered * (tp - 1) / tp), where
            reduces = micro * ((r == 0) + (r == pp - 1))  # first stage: embedding; last: dX
            assert records["tp_vocab/all_reduce"] == (reduces, reduces * big,
                                                      reduces * big * 2 * (tp - 1) / tp), where


def test_vocab_sp_traffic_is_counted_and_equals_its_volume(dist, small_data_dir, tmp_path):
    """Under sequence parallelism, per microbatch and training step, every rank all-gathers its
    [3, b s] statistics, X (S) and the embedding's gradient (b s h fp32 each) over tp, and
    reduce-scatters its part of dX (T) and its partial embedding (b s h fp32 each); no
    all-reduce. Over pp each tp slice sends and receives what tp = 1 does, the same calls, with
    every message but the statistics a 1/t sequence shard. Counted exactly, on axis tp_vocab
    (t = 2: an all-gather's wire bytes are half its output, a reduce-scatter's half its input)."""
    results, alone, tokens, dim = traffic_runs(dist, small_data_dir, tmp_path, True)
    micro, pp, tp = TRAFFIC
    big, gathered = tokens * dim * 4, tp * 3 * tokens * 4
    stats = micro * (pp - 1) * 3 * tokens * 4  # each way, per rank: [3, b s] to every other
    for result in results:
        for step, records in enumerate(result["observed"]):
            r = records["pp_rank"]
            where = f"pp rank {r} step {step + 1}: {records}"
            for way in ("send", "recv"):
                calls, payload, wire = alone[r]["observed"][step][way]
                shards = (payload - stats) // tp + stats
                # (the ledger counts a message's wire bytes at its sender)
                assert records[way] == (calls, shards, shards if wire else 0), f"{where} {way}"
            assert records["tp_vocab/all_gather"] == (
                3 * micro, micro * (gathered + 2 * big),
                micro * (gathered + 2 * big) * (tp - 1) / tp), where
            assert records["tp_vocab/reduce_scatter"] == (
                2 * micro, 2 * micro * big, 2 * micro * big * (tp - 1) / tp), where
            assert records["tp_vocab/all_reduce"] == (0, 0, 0), where


# Checkpoints: each rank's rows are saved at their offset in the [V, D] weight (pipeline block
# from ``VocabRows``, tp part from the DTensor's placement), so a pp2 x tp2 checkpoint holds the
# whole weights and their moments, bit-identical to what one process loads, and back.
def checkpoint_layout(name: str) -> tuple[int, dict]:
    from tests.dist.test_vocab_pp_checkpoint import BASE as CKPT_BASE
    from tests.dist.test_vocab_pp_checkpoint import layout

    tp_layouts = {
        "vocab-pp2xtp2": (4, {"parallel.vocab_parallel_pp": True}, {"pp": 2, "tp": 2}),
        "vocab-pp2xtp2-zbv-tied": (4, {"parallel.vocab_parallel_pp": True,
                                       "model.tie_embeddings": True},
                                   {"pp": 2, "tp": 2, "schedule": "zbv"}),
    }
    if name not in tp_layouts:
        return layout(name)
    world, overrides, parallel = tp_layouts[name]
    return world, layout_config({**CKPT_BASE, **overrides}, world, **parallel)


RESHARDS = [("vocab-pp2xtp2", "single"), ("single", "vocab-pp2xtp2"),
            ("vocab-pp2xtp2-zbv-tied", "single-tied"), ("vocab-pp2xtp2", "vocab-pp4")]


# CI: into and out of vocab-pp2 x tp2 (the tied ZB-V source); into vocab-pp4 from pp2 runs in
# test_vocab_pp_checkpoint.py, so the tp source to pp4 is the matrix's
@pytest.mark.parametrize("source, target", matrix(RESHARDS, ci=RESHARDS[1:3]),
                         ids=[f"{s}-to-{t}" for s, t in RESHARDS])
def test_a_vocab_tp_checkpoint_reshards_bit_exactly(dist, small_data_dir, tmp_path, source,
                                                    target):
    from tests.dist.test_checkpoint_resume import check_reshard

    check_reshard(dist, small_data_dir, tmp_path, checkpoint_layout(source),
                  checkpoint_layout(target), f"{source} -> {target}")


@pytest.mark.matrix  # 34 s; vocab-pp resumes run in CI (test_vocab_pp_checkpoint.py), tp reshards above
def test_a_vocab_tp_run_resumes_bit_exactly(dist, small_data_dir, tmp_path):
    from tests.dist.test_checkpoint_resume import check_resume

    world, config = checkpoint_layout("vocab-pp2xtp2")
    check_resume(dist, small_data_dir, tmp_path, world, config, "vocab-pp2xtp2")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_rank_loads_its_rows_of_pretrained_weights(dist, small_data_dir, tmp_path, tied):
    """``model.init_from`` (``loom.parallel.load``): each of the p t ranks reads exactly its rows
    (the pipeline block's offset plus the tp shard's): the weights gathered back are the
    directory's, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from tests.dist.test_vocab_pp_init_from import BASE as INIT_BASE
    from tests.dist.test_vocab_pp_init_from import VOCAB as INIT_VOCAB
    from tests.dist.test_vocab_pp_init_from import run_directory, saved_weights

    source = run_directory(tmp_path, tied)
    out = tmp_path / "loaded.safetensors"
    table = layout_config({**INIT_BASE, **INIT_VOCAB, "model.init_from": source,
                           "train.seed": 1}, 4, pp=2, tp=2)
    dist.run(4, saved_weights, table, small_data_dir, str(out))
    loaded, saved = load_file(out), load_file(f"{source}/model.safetensors")
    assert loaded.keys() == saved.keys()
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name


@pytest.mark.parametrize("dtype", ["bf16", "bf16_autocast"])
def test_bf16_vocab_tp_matches_one_bf16_process(dist, small_data_dir, dtype):
    """bf16 parameters with fp32 masters (DTensor rows), or bf16 autocast, at pp2 x tp2 against
    one process in the same mode: tests/dist/test_vocab_pp_bf16.py's bounds and reasons (the
    first loss to fp32 parity's first-step bound, the first step's gradients to bf16's bound
    for a layout that computes in another order); here dX is also summed over tp, in fp32."""
    from loom.testing.parity import record_training
    from tests.dist.test_vocab_pp_bf16 import BASE, STEPS, assert_bf16_first_step

    overrides = {**BASE, "train.dtype": dtype, "parallel.schedule": "1f1b"}
    reference = dist.run(1, record_training, layout_config(overrides, 1), small_data_dir,
                         STEPS)[0]
    table = layout_config({**overrides, "parallel.vocab_parallel_pp": True}, 4, pp=2, tp=2)
    for rank, result in enumerate(dist.run(4, record_training, table, small_data_dir, STEPS)):
        assert_bf16_first_step(reference, result, f"vocab-pp2xtp2 {dtype} rank {rank}")
    assert len(set(reference["loss"])) == STEPS  # it trained
