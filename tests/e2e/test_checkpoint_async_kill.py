"""A SIGKILL during an asynchronous checkpoint's background write: training went on during the
write, the interrupted checkpoint stays an uncommitted ``.partial`` directory, the previous one is
still the newest complete checkpoint, and a new run resumes from it.

The write is held (DCP's file writer waits before writing, as on a very slow disk) so the kill
lands inside it every time; everything else is the real Trainer and checkpoint code in a child
process of its own. (Through ``loom train``, that asynchronous checkpoints are committed before
the run exits and do not change the trained weights is test_fault_restart.py's.)
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

from loom.config import from_dict
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 6,
        "train.global_batch_size": 4, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0, "checkpoint.async_save": True}


def train_and_hang_in_a_write(config_table: dict, data_dir: str, run_dir: str,
                              signals: str) -> None:
    """Child process: a complete checkpoint at step 2, then one at step 3 whose write never
    finishes; a training step runs during it. Signals each stage with a file, then waits."""
    from torch.distributed.checkpoint import FileSystemWriter

    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, run_dir)
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.wait_for_checkpoint()  # step 2 is committed

    def held(self, plan, planner):
        (Path(signals) / "writing").touch()
        time.sleep(600)  # killed long before

    trainer.train_step()
    FileSystemWriter.write_data = held
    trainer.save_checkpoint()  # step 3: returns once staged; the write hangs in the background
    trainer.train_step()
    (Path(signals) / "stepped").touch()
    time.sleep(600)


def resumed_step(ctx, config_table, data_dir, run_dir):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, run_dir, ctx)
    found = trainer.resume("auto", log=lambda msg: None)
    return str(found), trainer.step


def test_a_kill_during_the_background_write_keeps_the_previous_checkpoint(
        dist, small_data_dir, tmp_path):
    from loom.train.checkpoint import complete_checkpoints, latest_loadable, step_dir

    config = layout_config(BASE, 1)
    run_dir, signals = tmp_path / "run", tmp_path / "signals"
    run_dir.mkdir()
    signals.mkdir()
    child = mp.get_context("spawn").Process(
        target=train_and_hang_in_a_write, args=(config, small_data_dir, str(run_dir),
                                                str(signals)), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 240
        while not ((signals / "writing").exists() and (signals / "stepped").exists()):
            assert child.is_alive(), f"the child exited early (code {child.exitcode})"
            assert time.monotonic() < deadline, "the child never reached the held write"
            time.sleep(0.2)
    finally:
        child.kill()
        child.join(30)
    assert child.exitcode == -9

    root = run_dir / "checkpoints"
    assert complete_checkpoints(root) == [step_dir(root, 2)]
    interrupted = step_dir(root, 3).with_name(step_dir(root, 3).name + ".partial")
    assert interrupted.is_dir() and not (interrupted / "COMMITTED").exists()
    newest, refused = latest_loadable(root)
    assert newest == step_dir(root, 2) and refused == []
    path, step = dist.run(1, resumed_step, config, small_data_dir, str(run_dir))[0]
    assert (path, step) == (str(step_dir(root, 2)), 2)
