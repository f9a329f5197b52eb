"""Specifications for loom.train.trackers: what the W&B run is told (a stand-in ``wandb`` module
records it; tests/e2e/test_cli_everyday_tools.py runs the real one offline)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from loom.config import load_config
from loom.train.trackers import WandbTracker, open_trackers, wandb_run_id


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch):
    module = types.SimpleNamespace(calls=[], fail=None)

    def init(**kwargs):
        module.calls.append(kwargs)
        if module.fail is not None:
            raise module.fail
        module.run = FakeRun()
        return module.run

    module.init = init
    module.Settings = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_the_run_is_named_after_the_run_directory(fake_wandb, tmp_path: Path) -> None:
    config = load_config(None, {"metrics.wandb": "true", "metrics.wandb_project": "p"})
    run_dir = tmp_path / "runs" / "exp1"
    run_dir.mkdir(parents=True)
    [tracker] = open_trackers(config, run_dir, is_main=True)
    call = fake_wandb.calls[0]
    assert call["project"] == "p" and call["name"] == "exp1" and call["dir"] == str(run_dir)
    assert call["id"] == wandb_run_id(run_dir) and call["resume"] == "allow"
    assert call["config"]["metrics"]["wandb_project"] == "p"
    assert call["settings"] == {"console": "off"}
    tracker.log({"train/loss": 1.5}, 3)
    tracker.log({}, 4)  # nothing numeric at this step: no empty history row
    tracker.close()
    assert fake_wandb.run.logged == [({"train/loss": 1.5}, 3)] and fake_wandb.run.finished
    assert open_trackers(config, run_dir, is_main=False) == []
    assert open_trackers(config, None, is_main=True) == []
    assert open_trackers(load_config(), run_dir, is_main=True) == []
    assert len(fake_wandb.calls) == 1


def test_the_run_id_is_stable_per_directory(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert wandb_run_id(a) == wandb_run_id(tmp_path / "a" / ".." / "a" / "run")
    assert wandb_run_id(a) != wandb_run_id(b) and wandb_run_id(a).startswith("loom-")


def test_a_failed_init_names_the_field(fake_wandb, tmp_path: Path) -> None:
    fake_wandb.fail = ValueError("api_key not configured (no-tty)")
    with pytest.raises(RuntimeError, match=r"metrics.wandb: wandb.init failed: api_key not"
                                           r" configured .*WANDB_MODE=offline"):
        WandbTracker("loom", tmp_path, {})
