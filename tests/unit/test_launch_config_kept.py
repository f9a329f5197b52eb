"""A launch that fails before it saves a checkpoint leaves the run directory's ``config.toml`` as
it found it (``loom.launch.config_kept_unless_checkpointed``, used by ``run_job``): the
earlier run's, which that run's checkpoints belong to, or none. The workers' start is replaced
by a stand-in that fails the way a worker does (``WorkerFailed``) or is interrupted; the
config is written by the real ``prepare_run_dir``."""

from __future__ import annotations

import signal

import pytest

import loom.launch
from loom.config import Config, to_toml
from loom.launch import WorkerFailed, run_job
from loom.supervise import Interrupted

EARLIER = "# the earlier run's config\n"


@pytest.fixture
def config() -> Config:
    config = Config()
    config.train.steps = 7  # differs from the earlier run's
    return config


def _workers(monkeypatch, failure: BaseException | None, checkpoint: str | None = None):
    """Workers that save ``checkpoint`` (a step directory) and then fail with ``failure``."""
    def launch_local(config, run_dir, nproc, max_restarts=0, emulate=None):
        assert (run_dir / "config.toml").read_text() == to_toml(config)  # written before
        if checkpoint is not None:
            (run_dir / "checkpoints" / checkpoint).mkdir(parents=True)
        if failure is not None:
            raise failure
        return {}
    monkeypatch.setattr(loom.launch, "launch_local", launch_local)
    monkeypatch.setattr(loom.launch, "under_external_launcher", lambda: False)


@pytest.mark.parametrize("failure, code", [(WorkerFailed("rank 1 failed: OSError"), 1),
                                           (Interrupted("interrupted", signal.SIGINT), 130)])
def test_a_start_that_fails_puts_the_earlier_config_back(tmp_path, monkeypatch, capsys,
                                                         config, failure, code):
    (tmp_path / "checkpoints" / "step_00000005").mkdir(parents=True)
    (tmp_path / "config.toml").write_text(EARLIER)
    _workers(monkeypatch, failure)
    assert run_job(config, tmp_path, nproc=2) == code
    assert (tmp_path / "config.toml").read_text() == EARLIER
    assert not (tmp_path / "config.toml.tmp").exists()
    capsys.readouterr()


def test_a_failed_first_start_leaves_no_config(tmp_path, monkeypatch, capsys, config):
    _workers(monkeypatch, WorkerFailed("rank 0 failed"))
    assert run_job(config, tmp_path, nproc=2) == 1
    assert not (tmp_path / "config.toml").exists()
    assert (tmp_path / "data").is_dir()  # the token files are the data's, not the run's: kept
    capsys.readouterr()


def test_a_failure_after_a_checkpoint_keeps_the_new_config(tmp_path, monkeypatch, capsys,
                                                           config):
    """The checkpoint the failed launch saved was made with the new config: it describes it."""
    (tmp_path / "config.toml").write_text(EARLIER)
    _workers(monkeypatch, WorkerFailed("rank 1 failed"), checkpoint="step_00000003")
    assert run_job(config, tmp_path, nproc=2) == 1
    assert (tmp_path / "config.toml").read_text() == to_toml(config)
    capsys.readouterr()


def test_a_launch_that_ends_well_keeps_the_new_config(tmp_path, monkeypatch, config):
    (tmp_path / "config.toml").write_text(EARLIER)
    _workers(monkeypatch, None)
    assert run_job(config, tmp_path, nproc=2) == 0
    assert (tmp_path / "config.toml").read_text() == to_toml(config)
