"""Parity of a parallel layout with one process: same model, seed and data -> same numbers.

``record_training(ctx, config_table, data_dir, steps)`` runs on every rank of a ``WorkerPool``:
it builds a ``Trainer`` for the config and records, after each optimizer step, the loss, the
gradient norm and every parameter's gradient by name. Run it once on a 1-rank pool (the
reference) and once on the layout under test, then ``assert_parity`` compares them with the
tolerances the test states.

Rules a parallel layout must keep for this to be meaningful: the global batch and the order of
samples are the same as one process's (the data loader guarantees it), the loss is the mean over
the global batch, and ``Trainer.named_gradients`` returns full (unsharded) gradients under the
plain model's parameter names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loom.config import Config, from_dict, load_config, resolve, to_dict
from loom.train.trainer import Trainer


def layout_config(base: dict[str, Any], world_size: int, **parallel: int) -> dict[str, Any]:
    """A resolved config table: ``base`` overrides (``"train.steps": 3`` ...) plus degrees."""
    overrides = dict(base)
    overrides.update({f"parallel.{axis}": degree for axis, degree in parallel.items()})
    config: Config = resolve(load_config(None, overrides), world_size)
    return to_dict(config)


def record_training(ctx: Any, config_table: dict[str, Any], data_dir: str, steps: int) -> dict:
    """Train ``steps`` steps; per step: loss, grad norm, every named gradient (on CPU) and,
    for an MoE model, the logged load-balancing loss."""
    return train_and_record(Trainer(from_dict(config_table), Path(data_dir), None, ctx), steps)


def train_and_record(trainer: Trainer, steps: int) -> dict:
    """``record_training``'s loop on a trainer the caller built (or instrumented)."""
    record: dict[str, list] = {"loss": [], "grad_norm": [], "grads": [], "moe_aux_loss": []}
    for _ in range(steps):
        metrics = trainer.train_step()
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            if key in metrics:
                record[key].append(metrics[key])
        record["grads"].append({k: v.cpu() for k, v in trainer.named_gradients().items()})
    return record


def assert_parity(reference: dict, candidate: dict, *, rtol: float, atol: float,
                  label: str = "", steps: range | None = None) -> None:
    """Loss, grad norm, every parameter's gradient and (MoE) the logged load-balancing loss
    equal within tolerance, for each step in ``steps`` (0-based; default all)."""
    n_steps = len(reference["loss"])
    assert len(candidate["loss"]) == n_steps, f"{label}: {len(candidate['loss'])} vs {n_steps} steps"
    for step in steps if steps is not None else range(n_steps):
        where = f"{label} step {step + 1}"
        torch.testing.assert_close(torch.tensor(candidate["loss"][step]),
                                   torch.tensor(reference["loss"][step]),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{where} loss: {m}")
        torch.testing.assert_close(torch.tensor(candidate["grad_norm"][step]),
                                   torch.tensor(reference["grad_norm"][step]),
                                   rtol=rtol, atol=atol, msg=lambda m: f"{where} grad norm: {m}")
        if reference.get("moe_aux_loss"):
            torch.testing.assert_close(torch.tensor(candidate["moe_aux_loss"][step]),
                                       torch.tensor(reference["moe_aux_loss"][step]), rtol=rtol,
                                       atol=atol, msg=lambda m: f"{where} moe_aux_loss: {m}")
        ref_grads, got_grads = reference["grads"][step], candidate["grads"][step]
        assert set(got_grads) == set(ref_grads), (
            f"{where}: parameters differ: missing {sorted(set(ref_grads) - set(got_grads))},"
            f" extra {sorted(set(got_grads) - set(ref_grads))}")
        for name, ref in ref_grads.items():
            torch.testing.assert_close(got_grads[name], ref, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{where} grad of {n}: {m}")
