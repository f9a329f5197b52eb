"""What ``loom train`` checks of a checkpoint before it resumes from it, in the launching process:
the training state in extra.json (``training_state_refusal``), the seed of the data order, and
the model's weight shapes from DCP's metadata (``model_shape_refusal``). Each returns the reason
as a line, or None. Split from ``loom.train.checkpointing`` so the commands import it at start-up
without that module's DTensor and parallel layer; the workers' load checks the training state
with the same function.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from loom.config import Config, model_args
from loom.models.llama import build_model
from loom.train import checkpoint
from loom.train.checkpoint_safety import load_metadata


def _is_count(value: Any, low: int = 0) -> bool:
    return type(value) is int and low <= value < checkpoint.MAX_STEP


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def training_state_refusal(extra: Any) -> str | None:
    """Why extra.json's training state (what ``save`` writes beside the step) cannot be
    continued, or None: the data position (``data``: seed, sample counts) and the LR schedule's
    state (``scheduler``: LambdaLR's counters and rates) with the types and ranges ``save``
    writes. The low-level checks (``checkpoint.verify``) know only the step; an extra.json
    edited and re-hashed would otherwise fail in every worker, or resume at a negative
    sample."""
    if not isinstance(extra, dict):
        return "not a table"
    data = extra.get("data")
    if not isinstance(data, dict):
        return "no data table (the data loader's position)"
    # (global_batch_size and num_samples: optional, as ``DataLoader.load_state_dict`` reads them)
    for key, low in (("seed", 0), ("consumed_samples", 0), ("global_batch_size", 1),
                     ("num_samples", 1)):
        if (key in data or key in ("seed", "consumed_samples")) and not _is_count(data.get(key),
                                                                                   low):
            return (f"data.{key} = {data.get(key)!r} is not an integer in"
                    f" [{low}, 2^62)")
    scheduler = extra.get("scheduler")
    if not isinstance(scheduler, dict):
        return "no scheduler table (the LR schedule's state)"
    for key, low in (("last_epoch", -1), ("_step_count", 0)):
        if not _is_count(scheduler.get(key), low):
            return (f"scheduler.{key} = {scheduler.get(key)!r} is not an integer in"
                    f" [{low}, 2^62)")
    for key in ("base_lrs", "_last_lr"):
        rates = scheduler.get(key, [])
        if not isinstance(rates, list) or not all(_is_number(rate) for rate in rates):
            return f"scheduler.{key} is not a list of finite numbers"
    return None


def resume_state_refusal(config: Config, path: Path) -> str | None:
    """Why the verified checkpoint at ``path`` cannot continue under ``config``, or None: its
    training state (``training_state_refusal``) or its model (``model_shape_refusal``).
    ``loom train`` asks this before it launches anything."""
    try:
        extra = checkpoint.read_extra(path)
    except checkpoint.CheckpointError as err:
        return str(err)
    refusal = training_state_refusal(extra)
    if refusal:
        return f"{path / checkpoint.EXTRA}: {refusal}"
    if extra["data"]["seed"] != config.train.seed:  # the loader's own check, before the launch
        return (f"{path}: saved with train.seed = {extra['data']['seed']}, this run has"
                f" {config.train.seed}: the samples after the resume would be other ones")
    return model_shape_refusal(config, path)


def model_shape_refusal(config: Config, path: Path) -> str | None:
    """Why the (verified) checkpoint at ``path`` cannot load into the model ``config`` builds,
    or None: a weight of another shape, one the model lacks, or one the checkpoint lacks. Read
    from DCP's metadata against a meta-device model, so ``loom train`` refuses a resume with
    another model shape before any worker starts (the workers' DCP load would refuse it too,
    after the launch). Saved names are ``model.<name>``, under ``replica<r>.`` in outer modes."""
    try:
        metadata = load_metadata(path)
    except checkpoint.CheckpointError as err:
        return str(err)
    saved: dict[str, tuple[int, ...]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        parts = key.split(".")
        if parts[0].startswith("replica") and parts[0][len("replica"):].isdigit():
            parts = parts[1:]
        if parts[0] == "model" and hasattr(entry, "size"):
            saved.setdefault(".".join(parts[1:]), tuple(entry.size))
    mine = {name: tuple(value.shape)
            for name, value in build_model(model_args(config), device="meta").state_dict().items()}
    for name, shape in mine.items():
        if name not in saved:
            return f"{path}: holds no weight {name}, which this model has (another model shape)"
        if saved[name] != shape:
            return (f"{path}: weight {name} is {list(saved[name])} there, {list(shape)} in this"
                    " model (another model shape; --model.* must match the checkpoint's)")
    unknown = sorted(set(saved) - set(mine))
    if unknown:
        return (f"{path}: holds {len(unknown)} weight(s) this model lacks, e.g. {unknown[0]}"
                " (another model shape)")
    return None


__all__ = ["model_shape_refusal", "resume_state_refusal", "training_state_refusal"]
