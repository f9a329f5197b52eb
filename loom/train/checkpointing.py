"""What a ``Trainer`` saves in a checkpoint and how it continues from one.

``save`` writes the model and optimizer state keyed by the full model's parameter names
(``loom.train.checkpoint_state``, so any layout loads what any other saved), gradient
compression's per-rank state, the outer loop's per-replica state, and extra.json (step, LR
schedule, data position, config, SkipPipe's paths) through ``loom.train.checkpoint`` (DCP, hashes,
the atomic commit, asynchronous saves). ``load`` reads it back under this or another layout;
``resume`` picks the checkpoint (``auto``: the newest complete and valid one). Every function is
collective: all ranks call it. Split from ``trainer.py`` to keep that module about the step; the
``Trainer`` methods of the same names call these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from loom.config import to_dict
from loom.parallel.mixed_precision import master_window
from loom.parallel.vocab_pipeline import row_slices
from loom.pipeline.paths_runtime import PathPipeline
from loom.train import checkpoint
from loom.train.checkpoint_state import (experts_by_name_as_slices, load_training_state,
                                         training_state, zero_slices_by_name)
from loom.train.resume_checks import training_state_refusal

if TYPE_CHECKING:  # the trainer imports this module
    from loom.train.trainer import Trainer

# checkpoint.resume values that pick the newest valid checkpoint of the run by themselves
AUTO_RESUME = ("auto", "auto_or_fresh")


def checkpoint_tensors(trainer: Trainer) -> dict[str, Any]:
    """Model and optimizer state keyed by the full model's parameter names and shapes, so any
    layout can load what any other saved (``loom.train.checkpoint_state``).

    Outer modes: between outer steps every replica's weights and inner optimizer state are its
    own (and NoLoCo's snapshot always is), so the state, with the outer loop's tensors, goes
    under ``replica<r>``: unprefixed, DCP would keep one copy of what looks replicated and
    every replica would resume from replica 0's. Within a replica it reshards by name."""
    state = training_state(trainer.model, trainer.optimizer, zero=trainer.zero, ep=trainer.ep)
    compression = _compression_state(trainer)
    if compression:  # sync only (config rules): never beside the outer loop's replicas
        state["compression"] = compression
    if trainer.outer is None:
        return state
    outer = trainer.outer.state_dict()  # co2: waits for the average in flight (kept pending)
    state["outer"] = {key: _outer_tensors(trainer, value) for key, value in outer.items()
                      if isinstance(value, dict)}
    return {f"replica{trainer.replica}": state}


def _outer_tensors(trainer: Trainer, by_name: dict[str, Any]) -> dict[str, Any]:
    """One of the outer loop's per-parameter states, saved under the model's parameter names and
    full shapes so it reshards: under ZeRO-1/2 its entries are the optimizer's slices
    (``Trainer._outer_loop``), saved as the moments are; expert shards as boxes of the global
    tensors, as the weights are (collective: every rank, the same order). A load fills the
    outer loop's buffers in place (these are views of them)."""
    if trainer.zero is not None:
        per_bucket = [by_name[f"zero.bucket{i}"] for i in range(len(trainer.zero.buckets))]
        return zero_slices_by_name(trainer.zero, per_bucket, trainer.ep,
                                   row_slices(trainer.model))
    return experts_by_name_as_slices(trainer.model, trainer.ep, by_name)


def _compression_state(trainer: Trainer) -> dict[str, Any]:
    """Gradient compression's training state (``loom.parallel.compression``: error-feedback
    residuals, PowerSGD's Q, L-GreCo's levels and step count): every rank's own, so keyed by
    the global rank and stage; loaded back only under the same parallel config
    (``load``)."""
    state = {f"stage{index}": reducer.compressor.state_dict()
             for index, reducer in sorted(trainer.pipeline.reducers.items())
             if getattr(reducer, "compressor", None) is not None}
    if trainer.expert_compressor is not None:  # the expert shards' own (ep)
        state["experts"] = trainer.expert_compressor.state_dict()
    return {f"rank{trainer.ctx.rank}": state} if state else {}


def _same_parallel_config(trainer: Trainer, path: Path) -> bool:
    """Whether the checkpoint was saved under this run's ``[parallel]`` (extra.json)."""
    try:
        saved = json.loads((Path(path) / checkpoint.EXTRA).read_text())["config"]["parallel"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return saved == to_dict(trainer.config)["parallel"]


def _outer_counters(trainer: Trainer) -> dict[str, Any]:
    """The outer loop's plain state (the same on every rank): extra.json's ``outer``."""
    outer = trainer.outer.state_dict() if trainer.outer is not None else {}
    return {key: value for key, value in outer.items() if not isinstance(value, dict)}


def save(trainer: Trainer, root: Path) -> Path:
    """Save the full training state as checkpoint ``step`` under ``root`` (collective).
    With ``checkpoint.async_save`` the write continues in the background (one at a time:
    this first waits for the previous one); the returned path exists once it is committed."""
    trainer.wait_for_checkpoint()
    _refuse_non_finite_weights(trainer)
    extra = {"step": trainer.step, "scheduler": trainer.scheduler.state_dict(),
             "data": trainer.loader.state_dict(), "config": to_dict(trainer.config)}
    if trainer.outer is not None:
        extra["outer"] = _outer_counters(trainer)
    if isinstance(trainer.pipeline, PathPipeline):  # skippipe: the paths it trains on
        extra["skippipe"] = trainer.pipeline.state_dict()
    with master_window(trainer.model):  # bf16 parameters: their fp32 masters are saved
        saved = checkpoint.save(root, trainer.step, checkpoint_tensors(trainer), extra,
                                keep=trainer.config.checkpoint.keep, device=trainer.ctx.device,
                                async_save=trainer.config.checkpoint.async_save)
    if isinstance(saved, checkpoint.PendingSave):
        trainer._pending_save, saved = saved, saved.path
    return saved


def _refuse_non_finite_weights(trainer: Trainer) -> None:
    """A checkpoint never holds NaN or infinity: checked on every rank's local values."""
    bad = torch.zeros((), device=trainer.ctx.device)
    for param in trainer.model.parameters():
        local = getattr(param, "_local_tensor", param)
        if not torch.isfinite(local).all():
            bad.fill_(1)
            break
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise checkpoint.CheckpointError(f"refusing to save step {trainer.step}: the weights"
                                         " hold non-finite values")


def load(trainer: Trainer, path: Path, *, verified: bool = False) -> None:
    """Continue from a checkpoint saved under this or any other layout (collective);
    ``verified``: rank 0 has just verified it (``checkpoint.load`` does not hash it again)."""
    _refuse_other_dp_mode(trainer, path)
    with master_window(trainer.model):  # bf16 parameters: loaded into their fp32 masters
        _load(trainer, path, verified)


def _load(trainer: Trainer, path: Path, verified: bool) -> None:
    """``load``'s body (inside the master window)."""
    tensors = checkpoint_tensors(trainer)
    if "compression" in tensors and not _same_parallel_config(trainer, path):
        # Saved under another layout or compression: its per-rank residuals do not map onto
        # this one's, so compression restarts (zero residuals, the seeded warm-start Q).
        del tensors["compression"]
    extra = checkpoint.load(path, tensors, device=trainer.ctx.device, verified=verified)
    refusal = training_state_refusal(extra)
    if refusal:  # loom train checks this before the launch; a torchrun job's ranks check here
        raise checkpoint.CheckpointError(f"{path / checkpoint.EXTRA}: {refusal}")
    if trainer.outer is not None:
        tensors = tensors[f"replica{trainer.replica}"]
        del tensors["outer"]  # loaded in place into the loop's buffers (``_outer_tensors``)
        outer = {key: value for key, value in trainer.outer.state_dict().items()
                 if isinstance(value, dict)}
        trainer.outer.load_state_dict({**extra["outer"], **outer})
    load_training_state(trainer.model, trainer.optimizer, tensors, zero=trainer.zero)
    trainer.step = int(extra["step"])
    trainer.scheduler.load_state_dict(extra["scheduler"])
    trainer.loader.load_state_dict(extra["data"])
    if isinstance(trainer.pipeline, PathPipeline) and "skippipe" in extra:
        trainer.pipeline.load_state_dict(extra["skippipe"])  # the paths it trained with


def _refuse_other_dp_mode(trainer: Trainer, path: Path) -> None:
    """A checkpoint's tensors are keyed per replica under an outer dp_mode (see
    ``checkpoint_tensors``): one saved under another dp_mode or dp_replicate is refused by
    name here rather than by DCP's missing keys. Reads extra.json's config (plain JSON; the
    files are verified by ``checkpoint.load`` next)."""
    try:
        saved = json.loads((Path(path) / checkpoint.EXTRA).read_text())["config"]["parallel"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable: checkpoint.load's verification names the problem
    par = trainer.config.parallel
    mine = (par.dp_mode, par.dp_replicate if par.dp_mode != "sync" else None)
    theirs = (saved.get("dp_mode", "sync"),
              saved.get("dp_replicate") if saved.get("dp_mode", "sync") != "sync" else None)
    if mine != theirs:
        raise checkpoint.CheckpointError(
            f"{path}: saved with parallel.dp_mode={theirs[0]} (dp_replicate={theirs[1]}),"
            f" resuming with dp_mode={mine[0]} (dp_replicate={mine[1]}): an outer mode keeps"
            " one state per replica, so its dp_mode and dp_replicate must stay the same")


def resume(trainer: Trainer, spec: str, log: Callable[[str], Any] = print) -> Path | None:
    """``spec`` is ``auto`` (the newest checkpoint of this run that is complete and valid;
    none: refuse, naming the ones skipped), ``auto_or_fresh`` (the same, but none: start
    from step 0) or a checkpoint directory. Refused checkpoints are logged, never loaded."""
    verified = spec in AUTO_RESUME  # latest_loadable verifies what it picks
    if not verified:
        path = Path(spec)
    else:
        found: list[Any] = [None, []]
        if trainer.ctx.is_main:  # one rank reads and hashes the files; all follow its choice
            found = list(checkpoint.latest_loadable(trainer.run_dir / "checkpoints"))
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        path, refused = found
        for reason in refused:
            log(f"resume: skipping {reason}")
        if path is None:
            if spec == "auto":
                raise checkpoint.CheckpointError(
                    f"checkpoint.resume=auto: no complete and valid checkpoint under"
                    f" {trainer.run_dir / 'checkpoints'} ({len(refused)} refused); pass"
                    " --resume auto_or_fresh to start from step 0 instead")
            log("resume: no complete and valid checkpoint found; starting from step 0")
            return None
    load(trainer, path, verified=verified)
    log(f"resume: continuing from {path} (step {trainer.step})")
    return path


__all__ = ["AUTO_RESUME", "checkpoint_tensors", "load", "resume", "save"]
