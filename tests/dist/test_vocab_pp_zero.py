"""Vocabulary parallelism across the pipeline under ZeRO is one process, split two more ways.

``parallel.vocab_parallel_pp`` puts rows [rV/p, (r+1)V/p) of the embedding and of the head on
pipeline rank r; with ``parallel.dp_shard`` > 1 those rows are reduced over the data axes as the
stages' parameters are (``loom.parallel.vocab_pipeline.data_parallel_rows``): ZeRO-1/2 give the
shard its own sharded optimizer, whose buckets the trainer steps and clips with the stages';
ZeRO-3 shards the rows at rest with FSDP2 and gathers them by hand for the step
(``GatheredRows``: the passes run where the schedule puts them, not in a forward). At
pp = 2 x dp_shard = 2 (4 ranks), three AdamW steps with clipping give the same loss, gradient
norm and every parameter's gradient (rows gathered over dp_shard, then concatenated in pp order)
as one process with the same global batch, then the same validation loss and saved weights:
1F1B (its ZeRO-3 stages resharded after every forward and backward, the rows gathered all
step regardless) and the paper's V variant (V-Half), untied and tied, every ZeRO stage; and at
8 ranks (matrix only) HSDP (dp_replicate = 2 x dp_shard = 2) and tp = 2 (the rows' ZeRO slices
taken of tp shards). CI runs ZeRO-1 on 1F1B and ZeRO-3 on V-Half; ``-m matrix`` the rest.

Tolerances are test_pipeline_parity.py's (fp32): step 1 rtol 1e-5 / atol 1e-6 (summation order
only: p shards' statistics, dp_shard's reduce-scatter against one process's accumulation), later
steps rtol 1e-4 / atol 1e-5 (Adam's amplification of rounding-level elements).

While the rows are gathered they are each rank's whole V/p rows; at rest (after the step) a
ZeRO-3 rank holds a 1/dp_shard slice of them, a ZeRO-1/2 rank its slice of their moments: both
observed. A checkpoint saved under pp2 x dp_shard2 with ZeRO holds the whole embedding and head
(each rank's slice at its offset), so another layout loads it bit-identically
(``check_reshard``), training continues there as the source run does, and a run stopped and
resumed in the same layout ends bit-identical; ``model.init_from`` fills each rank's slice from
its rows' region. Under ``train.dtype = bf16`` against one bf16 process, test_vocab_pp_bf16.py's
bounds. (All of these: matrix only.)
"""

from __future__ import annotations

import pytest

from loom.testing.parity import layout_config
from tests.conftest import matrix
from tests.dist.test_pipeline_parity import (BASE, STEPS, check, record_pipeline,
                                           tied_reference_runs)

VOCAB = {**BASE, "parallel.vocab_parallel_pp": True}
MICRO = 4  # microbatches per pipeline
CASES = [  # (schedule, ZeRO stage, tied, dp_replicate)
    ("1f1b", 1, False, 1),
    ("1f1b", 2, False, 1),
    ("1f1b", 3, False, 1),
    ("1f1b", 3, True, 1),
    ("1f1b", 1, True, 1),
    ("v_half", 3, False, 1),  # the V variant: the last stage beside the first on rank 0
    ("v_half", 2, True, 1),
    ("1f1b", 3, False, 2),  # HSDP: sharded over dp_shard, the shards averaged over dp_replicate
    ("1f1b", 1, False, 2),
]


@pytest.fixture(scope="module")
def references(dist, small_data_dir, tmp_path_factory):
    """One-process runs by (global batch, tied), computed on first use."""
    return tied_reference_runs(dist, small_data_dir, tmp_path_factory, BASE, STEPS)


def held_rows(trainer) -> dict:
    """What this rank holds of its vocabulary rows after the step (at rest): the weight's local
    rows (a ZeRO-3 slice of the pipeline rank's), the elements of the ZeRO-1/2 slices its
    optimizer steps, and the reducer's kind."""
    from loom.parallel.comm import local_shard

    weight = trainer.pipeline.vocab.output.weight
    reducer = trainer.pipeline.vocab_reducer
    zero = trainer.zero
    slices = 0 if zero is None else sum(
        b.shard.numel() for b in zero.buckets
        if any(n.startswith(("tok_embeddings", "output")) for n in b.names))
    return {"global": tuple(weight.shape), "local": tuple(local_shard(weight).shape),
            "slices": slices, "reducer": type(reducer).__name__}


@pytest.mark.parametrize("schedule, stage, tied, dp", matrix(CASES, ci=[
    ("1f1b", 1, False, 1), ("v_half", 3, False, 1)]),
    ids=[f"{s}-zero{z}{'-tied' if t else ''}{f'-hsdp{d}' if d > 1 else ''}"
         for s, z, t, d in CASES])
def test_vocab_parallel_pipeline_with_zero_matches_one_process(dist, small_data_dir, references,
                                                               tmp_path, schedule, stage, tied,
                                                               dp):
    check_case(dist, small_data_dir, references, tmp_path, schedule, stage, tied, dp)


@pytest.mark.parametrize("stage", matrix([1, 3], ci=[]))
def test_vocab_parallel_pipeline_with_zero_and_tp_matches_one_process(dist, small_data_dir,
                                                                      references, tmp_path,
                                                                      stage):
    """tp = 2 too (8 ranks): the rows split over pp x tp, each a DTensor on tp that ZeRO buckets
    by local shard (1/2) or FSDP2 shards again over dp_shard (3)."""
    check_case(dist, small_data_dir, references, tmp_path, "1f1b", stage, False, 1, tp=2)


def check_case(dist, small_data_dir, references, tmp_path, schedule: str, stage: int,
               tied: bool, dp: int, tp: int = 1) -> None:
    pp, shard = 2, 2
    world, batch = pp * shard * dp * tp, MICRO * shard * dp
    # V-Half splits the backward: its ZeRO-3 stages stay gathered across the step (config rule);
    # 1F1B's reshard after every forward and backward, while the rows stay gathered regardless
    config = layout_config({**VOCAB, "train.global_batch_size": batch,
                            "parallel.schedule": schedule, "model.tie_embeddings": tied,
                            "parallel.reshard_after_forward": schedule == "1f1b"},
                           world, pp=pp, dp_shard=shard, dp_replicate=dp, tp=tp,
                           zero_stage=stage)
    results = dist.run(world, record_pipeline, config, small_data_dir, STEPS, str(tmp_path),
                       held_rows)
    check(references(batch, tied), results,
          f"vocab {schedule} zero{stage} pp={pp} dp_shard={shard} dp_replicate={dp} tp={tp}")
    vocab, dim = config["model"]["vocab_size"], config["model"]["dim"]
    rows = vocab // pp
    matrices = 1 if tied else 2
    for result in results:
        for observed in result["observed"]:
            if stage == 3:  # the rows sharded at rest: 1/dp_shard of this rank's (over tp)
                assert observed == {"global": (rows, dim), "local": (rows // tp // shard, dim),
                                    "slices": 0, "reducer": "GatheredRows"}
            else:  # the rows whole, their optimizer slices 1/dp_shard of them
                assert observed == {"global": (rows, dim), "local": (rows // tp, dim),
                                    "slices": matrices * rows // tp * dim // shard,
                                    "reducer": "ZeroShardedOptimizer"}


# -- checkpoints ----------------------------------------------------------------------------------
def ckpt_layout(name: str) -> tuple[int, dict]:
    """test_vocab_pp_checkpoint.py's layouts, plus pp2 x dp_shard2 with vocab-pp at each ZeRO
    stage (4 ranks; 1F1B, 2 microbatches per pipeline)."""
    from tests.dist.test_vocab_pp_checkpoint import BASE as CKPT, LAYOUTS, VOCAB as ON

    zero = {f"vocab-pp2-zero{z}": (4, ON, {"pp": 2, "dp_shard": 2, "zero_stage": z,
                                           "schedule": "1f1b"}) for z in (1, 2, 3)}
    zero["vocab-pp2-zero2-tied"] = (4, {**ON, "model.tie_embeddings": True},
                                    {"pp": 2, "dp_shard": 2, "zero_stage": 2, "schedule": "1f1b"})
    for z in (1, 3):  # tp = 2 too: the rows' slices are slices of tp shards
        zero[f"vocab-pp2-tp2-zero{z}"] = (8, ON, {"pp": 2, "tp": 2, "dp_shard": 2,
                                                  "zero_stage": z, "schedule": "1f1b"})
    world, overrides, parallel = {**LAYOUTS, **zero}[name]
    return world, layout_config({**CKPT, **overrides}, world, **parallel)


RESHARDS = [("vocab-pp2-zero1", "vocab-pp2"), ("vocab-pp2-zero3", "single"),
            ("vocab-pp2", "vocab-pp2-zero3"), ("vocab-pp2-zero1", "vocab-pp2-zero3"),
            ("vocab-pp2-zero3", "vocab-pp2-zero2"), ("vocab-pp2-zero2-tied", "single-tied"),
            ("pp2-zbv-tied", "vocab-pp2-zero2-tied"), ("vocab-pp2-tp2-zero3", "single"),
            ("vocab-pp2-tp2-zero1", "vocab-pp2-zero3")]


@pytest.mark.parametrize("source, target", matrix(RESHARDS, ci=[]),
                         ids=[f"{s}-to-{t}" for s, t in RESHARDS])
def test_a_vocab_zero_checkpoint_reshards_bit_exactly(dist, small_data_dir, tmp_path, source,
                                                      target):
    """Saved after 2 steps, loaded under another layout: every weight and optimizer tensor
    bit-identical (full tensors gathered by name)."""
    from tests.dist.test_checkpoint_resume import check_reshard

    check_reshard(dist, small_data_dir, tmp_path, ckpt_layout(source), ckpt_layout(target),
                  f"{source} -> {target}")


@pytest.mark.parametrize("name", matrix(["vocab-pp2-zero1", "vocab-pp2-zero3"], ci=[]))
def test_a_vocab_zero_run_resumes_bit_exactly(dist, small_data_dir, tmp_path, name):
    from tests.dist.test_checkpoint_resume import check_resume

    world, config = ckpt_layout(name)
    check_resume(dist, small_data_dir, tmp_path, world, config, name)


CONTINUED = [("vocab-pp2-zero3", "single"), ("vocab-pp2-zero1", "vocab-pp2-zero3")]


@pytest.mark.parametrize("source, target", matrix(CONTINUED, ci=[]),
                         ids=[f"{s}-to-{t}" for s, t in CONTINUED])
def test_training_continues_across_layouts_as_the_source_run(dist, small_data_dir, tmp_path,
                                                             source, target):
    """After a load under another layout the next steps' losses are the source run's (the
    state is identical: only the layouts' summation orders differ)."""
    import torch

    from tests.dist.test_vocab_pp_checkpoint import (ATOL, ATOL_FIRST, BASE as CKPT, RTOL,
                                                     RTOL_FIRST, SAVE_AT, losses_after_load,
                                                     losses_around_save)

    (world, config), (target_world, target_config) = ckpt_layout(source), ckpt_layout(target)
    path, expected = dist.run(world, losses_around_save, config, small_data_dir,
                              str(tmp_path))[0]
    for rank, losses in enumerate(dist.run(target_world, losses_after_load, target_config,
                                           small_data_dir, path)):
        label = f"{source} -> {target} rank {rank}"
        assert len(losses) == len(expected) == CKPT["train.steps"] - SAVE_AT
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(expected[0]),
                                   rtol=RTOL_FIRST, atol=ATOL_FIRST, msg=lambda m: f"{label}: {m}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("stage, tp", matrix([(1, 1), (3, 1), (3, 2)], ci=[]))
def test_each_rank_loads_its_rows_of_pretrained_weights_under_zero(dist, small_data_dir,
                                                                   tmp_path, stage, tp):
    """``model.init_from``: each rank reads its slice of its rows (ZeRO-3: the FSDP2 shard's
    place in them, under tp a shard of its tp shard; ZeRO-1/2: the rows whole, the slices taken
    from them); the weights gathered back are the source's, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from tests.dist.test_vocab_pp_init_from import BASE as INIT, run_directory, saved_weights

    source = run_directory(tmp_path, tied=False)
    out = tmp_path / "loaded.safetensors"
    table = layout_config({**INIT, "parallel.vocab_parallel_pp": True, "model.init_from": source,
                           "train.seed": 1}, 4 * tp, pp=2, dp_shard=2, tp=tp,
                          zero_stage=stage)
    dist.run(4 * tp, saved_weights, table, small_data_dir, str(out))
    loaded, saved = load_file(out), load_file(f"{source}/model.safetensors")
    assert loaded.keys() == saved.keys()
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name


@pytest.mark.parametrize("stage", matrix([1, 3], ci=[]))
def test_bf16_vocab_parallel_pipeline_with_zero_matches_one_bf16_process(dist, small_data_dir,
                                                                         stage):
    """``train.dtype = bf16``: the rows' fp32 masters are ZeRO-1/2's slices or FSDP2's sharded
    parameters (gathered in bf16), as the stages'; against one bf16 process,
    test_vocab_pp_bf16.py's bounds and reasons (the first loss to fp32 parity's first-step
    bound, the first step's gradients to bf16's bound for a layout computing in another
    order)."""
    from loom.testing.parity import record_training
    from tests.dist.test_vocab_pp_bf16 import BASE as BF16, STEPS as BF16_STEPS, \
        assert_bf16_first_step

    overrides = {**BF16, "train.dtype": "bf16", "train.global_batch_size": 8}
    reference = dist.run(1, record_training, layout_config(overrides, 1), small_data_dir,
                         BF16_STEPS)[0]
    table = layout_config({**overrides, "parallel.vocab_parallel_pp": True,
                           "parallel.schedule": "1f1b"}, 4, pp=2, dp_shard=2, zero_stage=stage)
    for rank, result in enumerate(dist.run(4, record_training, table, small_data_dir,
                                           BF16_STEPS)):
        assert_bf16_first_step(reference, result, f"vocab-pp bf16 zero{stage} rank {rank}")
    assert len(set(reference["loss"])) == BF16_STEPS  # it trained
