"""A non-finite loss or gradient norm is caught on every rank before the optimizer step: the
default policy stops naming the step; `skip` counts it and leaves the weights untouched, until more
than `train.max_skipped_steps` were skipped; a checkpoint is never written with non-finite
weights."""

import math

import torch

from loom.config import from_dict
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 4,
        "train.global_batch_size": 4, "train.micro_batch_size": 2, "optim.warmup_steps": 1}


def _trainer(ctx, config_table, data_dir, run_dir=None):
    from loom.train.trainer import Trainer

    return Trainer(from_dict(config_table), data_dir, run_dir, ctx)


def nan_gradient_at_first_step(ctx, config_table, data_dir, run_dir):
    trainer = _trainer(ctx, config_table, data_dir, run_dir)
    poisoned = {"steps": {1}}
    weight = trainer.model.norm.weight
    weight.register_hook(lambda g: g * math.nan if trainer.step + 1 in poisoned["steps"] else g)
    before = weight.detach().clone()
    try:
        first = trainer.train_step()
    except FloatingPointError as err:
        return {"stopped": str(err)}
    unchanged = torch.equal(weight.detach(), before)
    second = trainer.train_step()
    trainer.save_checkpoint()
    return {"first": first, "second": second, "unchanged_after_skip": unchanged,
            "finite": all(torch.isfinite(p).all() for p in trainer.model.parameters())}


def nan_gradient_at_every_step(ctx, config_table, data_dir, run_dir):
    trainer = _trainer(ctx, config_table, data_dir, run_dir)
    trainer.model.norm.weight.register_hook(lambda g: g * math.nan)
    skipped = []
    try:
        for _ in range(trainer.config.train.steps):
            skipped.append(trainer.train_step()["skipped_steps"])
    except FloatingPointError as err:
        return {"skipped": skipped, "stopped": str(err)}
    return {"skipped": skipped, "stopped": None}


def nan_weights_are_never_saved(ctx, config_table, data_dir, run_dir):
    from loom.train.checkpoint import CheckpointError

    trainer = _trainer(ctx, config_table, data_dir, run_dir)
    with torch.no_grad():
        trainer.model.norm.weight[0] = math.inf
    try:
        trainer.save_checkpoint()
    except CheckpointError as err:
        return str(err)
    return None


def test_the_default_policy_stops_naming_the_step(dist, small_data_dir, tmp_path):
    results = dist.run(2, nan_gradient_at_first_step, layout_config(BASE, 2, dp_replicate=2),
                       small_data_dir, str(tmp_path))
    for result in results:  # every rank decides the same
        assert "non-finite" in result["stopped"] and "at step 1" in result["stopped"]


def test_skip_counts_the_step_and_applies_nothing(dist, small_data_dir, tmp_path):
    config = layout_config({**BASE, "train.nonfinite": "skip"}, 2, dp_replicate=2)
    for result in dist.run(2, nan_gradient_at_first_step, config, small_data_dir, str(tmp_path)):
        assert math.isnan(result["first"]["grad_norm"]) and result["first"]["skipped_steps"] == 1
        assert result["unchanged_after_skip"]
        assert math.isfinite(result["second"]["grad_norm"])
        assert result["second"]["skipped_steps"] == 1 and result["finite"]
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMMITTED").is_file()


def test_skip_stops_once_more_than_max_skipped_steps_were_skipped(dist, small_data_dir, tmp_path):
    config = layout_config({**BASE, "train.nonfinite": "skip", "train.max_skipped_steps": 2}, 2,
                           dp_replicate=2)
    for result in dist.run(2, nan_gradient_at_every_step, config, small_data_dir, str(tmp_path)):
        assert result["skipped"] == [1, 2]  # the cap is 2: the third skip stops the run
        assert "3 non-finite steps skipped" in result["stopped"]
        assert "train.max_skipped_steps=2" in result["stopped"]


def test_a_checkpoint_with_non_finite_weights_is_refused(dist, small_data_dir, tmp_path):
    messages = dist.run(2, nan_weights_are_never_saved, layout_config(BASE, 2, dp_replicate=2),
                        small_data_dir, str(tmp_path))
    assert all(m and "non-finite" in m for m in messages)
    assert not (tmp_path / "checkpoints").exists() or not any(
        (tmp_path / "checkpoints").iterdir())
