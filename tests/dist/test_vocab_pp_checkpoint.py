"""Checkpoints of vocabulary parallelism across the pipeline hold the whole embedding and head.

Under ``parallel.vocab_parallel_pp`` pipeline rank r holds rows [rV/p, (r+1)V/p) of the
embedding and of the head (and of their Adam moments) under the full model's names. A checkpoint
writes each rank's rows at their offset in the ``[V, D]`` weight (``VocabRows`` records it,
``loom.train.checkpoint_state`` makes the box), so it holds exactly what one process's holds:

* stopped after 2 of 4 steps and resumed under the same layout, the run ends bit-identical to one
  that never stopped (untied, tied, with dp_replicate = 2, whose replicas hold the same rows,
  and in bf16, whose checkpoint holds the rows' fp32 masters; and from an asynchronous save);
* saved after 2 steps and loaded under another layout — one process, plain pp (1F1B or ZB-V, the
  ends on other ranks), vocab-pp at another p (other rows per rank), and each of those back into
  vocab-pp; an MoE model's vocab-pp x ep = 2 to and from one process — every weight and optimizer tensor is bit-identical (``torch.equal``, full tensors
  gathered by name: ``check_reshard``);
* continued after such a load, the next steps' losses are those of the source run continued
  (the state is identical, so only the layouts' summation orders differ: step 1's tolerance of
  the parity tests, rtol 1e-5 / atol 1e-6, for the first step after the load, then 1e-4 / 1e-5);
* the command line: ``loom train`` with ``checkpoint.interval`` under vocab-pp, its last
  checkpoint and weights removed, ``--resume auto`` from the one before ends with final weights
  bit-identical to the run's own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from loom.config import from_dict
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_checkpoint_resume import check_reshard, check_resume

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 4,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0}
VOCAB = {"parallel.vocab_parallel_pp": True}
LAYOUTS = {  # name -> (world size, config overrides, parallel degrees and schedule)
    "single": (1, {}, {}),
    "single-tied": (1, {"model.tie_embeddings": True}, {}),
    "pp2-1f1b": (2, {}, {"pp": 2, "schedule": "1f1b"}),
    "pp2-zbv-tied": (2, {"model.tie_embeddings": True}, {"pp": 2, "schedule": "zbv"}),
    "vocab-pp2": (2, VOCAB, {"pp": 2, "schedule": "1f1b"}),
    "vocab-pp2-zbv-tied": (2, {**VOCAB, "model.tie_embeddings": True},
                           {"pp": 2, "schedule": "zbv"}),
    "vocab-pp4": (4, VOCAB, {"pp": 4, "schedule": "1f1b"}),
    "vocab-pp2xdp2": (4, VOCAB, {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}),
    "vocab-pp2-bf16": (2, {**VOCAB, "train.dtype": "bf16"}, {"pp": 2, "schedule": "1f1b"}),
    # an MoE model: the rows on every pipeline rank, the experts over ep
    "moe-single": (1, {"model.preset": "tiny-moe"}, {}),
    "moe-vocab-pp2xep2": (4, {**VOCAB, "model.preset": "tiny-moe"},
                          {"pp": 2, "ep": 2, "schedule": "1f1b"}),
}
SAVE_AT, RTOL_FIRST, ATOL_FIRST, RTOL, ATOL = 2, 1e-5, 1e-6, 1e-4, 1e-5


def layout(name: str) -> tuple[int, dict]:
    world, overrides, parallel = LAYOUTS[name]
    return world, layout_config({**BASE, **overrides}, world, **parallel)


# matrix: plain vocab-pp2, which each of the other three adds one thing to
@pytest.mark.parametrize("name", matrix(["vocab-pp2", "vocab-pp2-zbv-tied", "vocab-pp2xdp2",
                                         "vocab-pp2-bf16"], ci=["vocab-pp2-zbv-tied",
                                                                "vocab-pp2xdp2", "vocab-pp2-bf16"]))
def test_a_vocab_parallel_run_resumes_bit_exactly(dist, small_data_dir, tmp_path, name):
    world, config = layout(name)
    check_resume(dist, small_data_dir, tmp_path, world, config, name)


def test_a_vocab_parallel_run_resumes_bit_exactly_from_an_async_checkpoint(dist, small_data_dir,
                                                                          tmp_path):
    """``checkpoint.async_save``: the rows are staged to host memory before a training step
    changes them in place during the write (``test_checkpoint_async.async_stop_resume``)."""
    from tests.dist.test_checkpoint_async import async_stop_resume

    world, config = layout("vocab-pp2")
    config["checkpoint"]["async_save"] = True
    check_resume(dist, small_data_dir, tmp_path, world, config, "vocab-pp2 async",
                 stop_resume=async_stop_resume)


RESHARDS = [("vocab-pp2", "single"), ("single", "vocab-pp2"), ("vocab-pp2", "pp2-1f1b"),
            ("pp2-1f1b", "vocab-pp4"), ("vocab-pp4", "vocab-pp2"),
            ("vocab-pp2xdp2", "vocab-pp2"), ("vocab-pp2-zbv-tied", "single-tied"),
            ("pp2-zbv-tied", "vocab-pp2-zbv-tied"), ("moe-vocab-pp2xep2", "moe-single"),
            ("moe-single", "moe-vocab-pp2xep2")]


# CI: to and from one process, to a plain pipeline and back, the tied ZB-V pair
@pytest.mark.parametrize("source, target", matrix(RESHARDS, ci=[
    ("vocab-pp2", "single"), ("single", "vocab-pp2"), ("vocab-pp2", "pp2-1f1b"),
    ("pp2-1f1b", "vocab-pp4"), ("vocab-pp2-zbv-tied", "single-tied"),
    ("moe-vocab-pp2xep2", "moe-single")]),
    ids=[f"{s}-to-{t}" for s, t in RESHARDS])
def test_a_vocab_parallel_checkpoint_reshards_bit_exactly(dist, small_data_dir, tmp_path, source,
                                                          target):
    check_reshard(dist, small_data_dir, tmp_path, layout(source), layout(target),
                  f"{source} -> {target}")


def losses_around_save(ctx, config_table, data_dir, root):
    """Train SAVE_AT steps, save, train to the end: the checkpoint and the losses after it."""
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(SAVE_AT):
        trainer.train_step()
    path = trainer.save_checkpoint(root)
    losses = [trainer.train_step()["loss"] for _ in range(SAVE_AT, trainer.config.train.steps)]
    return str(path), losses


def losses_after_load(ctx, config_table, data_dir, path):
    """Load ``path`` and train to the end: the losses."""
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.load_checkpoint(path)
    assert trainer.step == SAVE_AT
    return [trainer.train_step()["loss"] for _ in range(SAVE_AT, trainer.config.train.steps)]


CONTINUED = [("vocab-pp2", "single"), ("single", "vocab-pp2"), ("vocab-pp2", "pp2-1f1b")]


@pytest.mark.parametrize("source, target", CONTINUED, ids=[f"{s}-to-{t}" for s, t in CONTINUED])
def test_training_continues_across_layouts_as_the_source_run(dist, small_data_dir, tmp_path,
                                                             source, target):
    (world, config), (target_world, target_config) = layout(source), layout(target)
    path, expected = dist.run(world, losses_around_save, config, small_data_dir,
                              str(tmp_path))[0]
    for rank, losses in enumerate(dist.run(target_world, losses_after_load, target_config,
                                           small_data_dir, path)):
        label = f"{source} -> {target} rank {rank}"
        assert len(losses) == len(expected) == BASE["train.steps"] - SAVE_AT
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(expected[0]),
                                   rtol=RTOL_FIRST, atol=ATOL_FIRST, msg=lambda m: f"{label}: {m}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"{label}: {m}")


@pytest.mark.slow  # 20 s of launches; the in-process tests above cover the same state
def test_loom_train_saves_and_resumes_a_vocab_parallel_run(tmp_path):
    from tests.e2e.test_fault_restart import ENV, _weights

    def train(*extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "loom", "train", "--nproc", "2", "--parallel.pp=2",
             "--parallel.vocab_parallel_pp=true", "--model.preset=debug", "--train.steps=4",
             "--checkpoint.interval=2", "--train.global_batch_size=4",
             "--train.micro_batch_size=1", "--data.seq_len=32", "--data.max_bytes=100000",
             "--train.eval_every=0", "--optim.warmup_steps=1", "--metrics.tensorboard=false",
             "--metrics.plot=false", "--train.run_dir=runs/vocab", *extra],
            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    train()
    run = tmp_path / "runs" / "vocab"
    expected = _weights(run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "model.safetensors").unlink()
    resumed = train("--resume", "auto")
    assert "resume: continuing from" in resumed and "(step 2)" in resumed, resumed[-3000:]
    got = _weights(run)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
