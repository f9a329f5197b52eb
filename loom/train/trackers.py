"""Experiment trackers beside TensorBoard: Weights & Biases (``metrics.wandb = true``).

A tracker gets exactly the scalars TensorBoard gets, under the same tags (``train/loss``,
``val/loss``, ``comm/...``), from :class:`loom.train.metrics.MetricsLogger` on rank 0 only (the
other ranks' numbers are the same reduced values, or their own timings). W&B is an optional
dependency (``pip install loom[wandb]``): ``loom train`` refuses ``metrics.wandb = true`` before
launch when the package is missing (``loom.config_rules``), so the import below only fails for a
caller that skipped the config rules.

The W&B run is named after the run directory and its id is derived from the directory's path, so
a resumed run (``--resume auto``) continues the same W&B run. W&B's own settings come from the
environment as usual (``WANDB_MODE=offline`` writes under ``run_dir/wandb`` without a network,
``WANDB_API_KEY``, ``WANDB_ENTITY``, ...).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from loom.config import Config, to_dict
from loom.train.metrics import Tracker


class WandbTracker:
    """One W&B run, logged from this process."""

    def __init__(self, project: str, run_dir: Path, config_table: dict[str, Any]) -> None:
        import wandb

        run_dir = Path(run_dir)
        try:
            self._run = wandb.init(
                project=project, name=run_dir.name, id=wandb_run_id(run_dir), resume="allow",
                dir=str(run_dir), config=config_table,
                # no console capture: W&B would wrap stdout/stderr under the progress bar
                settings=wandb.Settings(console="off"))
        except Exception as err:  # W&B raises its own types: no login, no network, bad project
            raise RuntimeError(f"metrics.wandb: wandb.init failed: {err} (log in with `wandb"
                               " login`, set WANDB_MODE=offline, or --metrics.wandb=false)"
                               ) from err

    def log(self, scalars: dict[str, float], step: int) -> None:
        if scalars:
            self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_run_id(run_dir: Path) -> str:
    """A W&B run id that is the same for every launch into ``run_dir`` (a resumed run continues
    its W&B run) and different for two directories of the same name."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"loom-{digest}"


def open_trackers(config: Config, run_dir: Path | None, is_main: bool) -> list[Tracker]:
    """The trackers ``config.metrics`` asks for, on the main rank of a run with a directory."""
    if not is_main or run_dir is None:
        return []
    trackers: list[Tracker] = []
    if config.metrics.wandb:
        trackers.append(WandbTracker(config.metrics.wandb_project, run_dir, to_dict(config)))
    return trackers


__all__ = ["WandbTracker", "open_trackers", "wandb_run_id"]
