"""Asynchronous checkpoints (``checkpoint.async_save``): the tensors are staged before the save call
returns and written in the background, so a training step can run during the write and the
checkpoint still holds the state at the save; it equals a synchronous save of the same state bit
for bit, and a run resumed from it continues bit-exactly.

To make "a training step runs during the write" certain rather than likely on a fast disk, the
tests hold DCP's file writer for a moment (``held_writes``): the write itself is DCP's own.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest

from loom.config import from_dict
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_checkpoint_resume import (assert_equal_states, check_resume,
                                               resume_and_finish, state_after_load)

STEPS = 4
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0}
LAYOUTS = {"dp2": {"dp_replicate": 2}, "zero1-dp2": {"dp_shard": 2, "zero_stage": 1},
           "tp2": {"tp": 2}}


def config_for(layout: str, async_save: bool) -> dict:
    return layout_config({**BASE, "checkpoint.async_save": async_save}, 2, **LAYOUTS[layout])


@contextlib.contextmanager
def held_writes(seconds: float):
    """DCP's file writer waits ``seconds`` before writing (a slow disk)."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    FileSystemWriter.write_data = slow
    try:
        yield
    finally:
        FileSystemWriter.write_data = original


def sync_then_async(ctx, config_table, data_dir, root):
    """Save the same state synchronously and asynchronously; a step runs during the async
    write. Returns both paths and whether the step finished before the commit."""
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(2):
        trainer.train_step()
    trainer.config.checkpoint.async_save = False
    sync_path = trainer.save_checkpoint(Path(root) / "sync")
    trainer.config.checkpoint.async_save = True
    with held_writes(2.0):
        async_path = trainer.save_checkpoint(Path(root) / "async")
        trainer.train_step()  # changes weights and moments in place while the write runs
        overlapped = not (async_path / "COMMITTED").exists()
        trainer.wait_for_checkpoint()
    return (str(sync_path), str(async_path), overlapped) if ctx.rank == 0 else None


def async_stop_resume(ctx, config_table, data_dir, run_dir, steps):
    from loom.train.trainer import Trainer

    first = Trainer(from_dict(config_table), data_dir, run_dir, ctx)
    for _ in range(steps // 2):
        first.train_step()
    with held_writes(1.0):
        first.save_checkpoint()
        first.train_step()  # during the write; not part of the checkpoint
        first.wait_for_checkpoint()
    del first
    return resume_and_finish(ctx, config_table, data_dir, run_dir, steps)


# dp2 and ZeRO-1 in the matrix: replicated state is the simplest case, and through the CLI an
# async dp2 run is compared with a sync one by tests/e2e/test_fault_restart.py; tp2's DTensor
# shards are the case a background copy can get wrong
@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=["tp2"]))
def test_an_async_checkpoint_equals_a_sync_one(dist, small_data_dir, tmp_path, layout):
    sync_path, async_path, overlapped = dist.run(2, sync_then_async, config_for(layout, False),
                                                 small_data_dir, str(tmp_path))[0]
    assert overlapped, "the step after the save should have finished before the commit"
    loaded = {}
    for name, path in (("sync", sync_path), ("async", async_path)):
        step, loaded[name] = dist.run(2, state_after_load, config_for(layout, False),
                                      small_data_dir, path)[0]
        assert step == 2
    assert_equal_states(loaded["async"], loaded["sync"], f"{layout}: async vs sync")
    for relative in ("rng/rank0.pt", "rng/rank1.pt"):
        assert (Path(async_path) / relative).read_bytes() == \
            (Path(sync_path) / relative).read_bytes(), relative
    extra = {name: json.loads((Path(path) / "extra.json").read_text())
             for name, path in (("sync", sync_path), ("async", async_path))}
    assert extra["async"]["config"]["checkpoint"].pop("async_save") is True
    assert extra["sync"]["config"]["checkpoint"].pop("async_save") is False
    assert extra["async"] == extra["sync"]


@pytest.mark.parametrize("layout", ["dp2", "zero1-dp2"])
def test_a_run_resumed_from_an_async_checkpoint_is_bit_exact(dist, small_data_dir, tmp_path,
                                                             layout):
    check_resume(dist, small_data_dir, tmp_path, 2, config_for(layout, True), f"{layout} async",
                 stop_resume=async_stop_resume, steps=STEPS)
