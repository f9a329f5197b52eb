"""CheckFree+ end to end (loom/pipeline/out_of_order.py, loom/train/checkfree_worker.py,
loom/relaunch.py): `loom train --fault.recovery=checkfree_plus` with four pipeline stages; the
FIRST stage's process is SIGKILLed at the start of step 2 and, after its replacement has trained,
the LAST stage's at the start of step 5 (irregular kill steps: ``fault.test_kill_steps``). Each time the survivors keep their state in memory and
the replacement is rebuilt from its one neighbour; the run finishes every step.

From the dumps the ranks wrote: the rebuilt stage's blocks are its neighbour's blocks bit for
bit, and its embedding (norm and head) is the neighbour's copy, which is bit for bit what the
lost stage held after its last step. The rebuilt stage's optimizer starts empty and its learning
rate is ``fault.recovery_lr_scale`` (1.1) times the schedule's. No checkpoint exists to be read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.checkfree_runs import logged_steps, pipeline_args, run_to_end

STEPS = 6
FAULT = ["--fault.test_kill_stages=0,3", "--fault.test_kill_steps=2,5",
         "--fault.dump_recovery=true"]
SCALE = 1.1  # fault.recovery_lr_scale's default


def _check_rebuild(dumps: Path, generation: int, lost: int, source: int, after_step: int,
                   end_names: set[str]) -> None:
    sent = torch.load(dumps / f"gen{generation}_rank{source}_sent.pt")
    rebuilt = torch.load(dumps / f"gen{generation}_rank{lost}_rebuilt.pt")
    lost_end = torch.load(dumps / f"step{after_step}_rank{lost}_end.pt")  # its last step's
    assert sent["step"] == rebuilt["step"] == lost_end["step"] == after_step
    assert sent["end_step"] == after_step and rebuilt["sources"] == [source]
    assert set(rebuilt["blocks"]) == set(sent["blocks"]) and rebuilt["blocks"]
    for key, value in rebuilt["blocks"].items():  # a copy of the neighbour's blocks
        assert torch.equal(value, sent["blocks"][key]), key
    assert set(rebuilt["end"]) == set(sent["end"]) == set(lost_end["end"]) == end_names
    for name, value in rebuilt["end"].items():  # the copy is what the lost stage held
        assert torch.equal(value, sent["end"][name]), name
        assert torch.equal(value, lost_end["end"][name]), name
    # a fresh optimizer, and the schedule's learning rate times the scale
    assert rebuilt["optimizer_states"] == 0
    assert rebuilt["scale"] == SCALE and sent["lr"] == rebuilt["source_lr"] > 0
    assert rebuilt["lr"] == pytest.approx(SCALE * sent["lr"], rel=1e-12)


def test_the_first_and_the_last_stage_are_rebuilt_from_their_neighbour(tmp_path):
    run_dir = tmp_path / "run"
    log = run_to_end(pipeline_args("checkfree_plus", STEPS, run_dir) + FAULT, 360)
    assert "worker rank 0 (stage 0) killed by signal 9" in log, log[-4000:]
    assert "worker rank 3 (stage 3) killed by signal 9" in log, log[-4000:]
    assert ("checkfree_plus: stage 0 (rank 0) rebuilt after step 1 from stage 1: a copy of its"
            " blocks" in log), log[-4000:]
    assert ("checkfree_plus: stage 3 (rank 3) rebuilt after step 4 from stage 2: a copy of its"
            " blocks" in log), log[-4000:]
    assert not (run_dir / "checkpoints").exists()
    assert "resume:" not in log
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    assert (run_dir / "model.safetensors").exists()

    dumps = run_dir / "checkfree"
    _check_rebuild(dumps, 1, lost=0, source=1, after_step=1, end_names={"tok_embeddings.weight"})
    _check_rebuild(dumps, 2, lost=3, source=2, after_step=4,
                   end_names={"norm.weight", "output.weight"})
