"""Checkpoints of tied embeddings across pipeline stages: one global name, any layout loads them.

Under pp > 1 the last stage's copy of the tied weight is saved under the embedding's name (and
``output.weight``, as the unsplit model's state dict has both), so a pp2 checkpoint holds exactly
the keys of a one-process one. Saved after 2 steps and loaded under the other layout, every weight
and optimizer tensor is bit-identical (``test_checkpoint_resume.check_reshard``: keys and values
with ``torch.equal``). Layouts: one process, pp2 1F1B (the ends on two ranks), pp2 ZB-V (one rank,
one shared Parameter), pp2 x ZeRO-1 on dp_shard 2 resharded to dp_shard 2 alone (the optimizer's
slices of each stage, the tied copy in a bucket of its own). A pp2 run (plain, and with ZeRO-1)
stopped and resumed ends bit-identical to one that did not stop,
and after loading, both copies are equal on both ranks and stay so through a training step.
"""

from __future__ import annotations

import pytest
import torch

from loom.config import from_dict
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES
from tests.dist.test_checkpoint_resume import check_reshard, check_resume

TIED = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.tie_embeddings": True,
        "train.steps": 4, "train.global_batch_size": 8, "train.micro_batch_size": 2,
        "optim.warmup_steps": 1, "train.eval_every": 0}
LAYOUTS = {"single": (1, {}), "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b"}),
           "pp2-zbv": (2, {"pp": 2, "schedule": "zbv"}),
           # ZeRO-1 on dp_shard 2: each stage's optimizer slices, the tied copy bucketed alone
           "pp2-zero1": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1, "schedule": "1f1b"}),
           "dp2-zero1": (2, {"dp_shard": 2, "zero_stage": 1})}


def _layout(name: str) -> tuple[int, dict]:
    world, parallel = LAYOUTS[name]
    return world, layout_config(TIED, world, **parallel)


@pytest.mark.parametrize("source, target", [("pp2-1f1b", "single"), ("single", "pp2-1f1b"),
                                            ("pp2-zbv", "single"), ("pp2-1f1b", "pp2-zbv"),
                                            ("pp2-zero1", "dp2-zero1")])
def test_a_tied_checkpoint_reshards_bit_exactly(dist, small_data_dir, tmp_path, source, target):
    check_reshard(dist, small_data_dir, tmp_path, _layout(source), _layout(target),
                  f"tied {source} -> {target}")


@pytest.mark.parametrize("layout", ["pp2-1f1b", "pp2-zero1"])
def test_a_tied_pipeline_resumes_bit_exactly(dist, small_data_dir, tmp_path, layout):
    world, config = _layout(layout)
    check_resume(dist, small_data_dir, tmp_path, world, config, f"tied {layout}")


def copies_after_load(ctx, config_table, data_dir, path):
    """This rank's copy of the tied weight right after loading ``path`` and after one step."""
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.load_checkpoint(path)
    loaded = trainer.pipeline.tied_weight.detach().clone()
    trainer.train_step()
    return loaded, trainer.pipeline.tied_weight.detach().clone()


def save_single(ctx, config_table, data_dir, root):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(2):
        trainer.train_step()
    return str(trainer.save_checkpoint(root)), trainer.model.tok_embeddings.weight.detach().clone()


def test_both_copies_load_the_one_saved_value(dist, small_data_dir, tmp_path):
    path, saved = dist.run(1, save_single, _layout("single")[1], small_data_dir, str(tmp_path))[0]
    world, config = _layout("pp2-1f1b")
    (first_loaded, first_next), (last_loaded, last_next) = dist.run(
        world, copies_after_load, config, small_data_dir, path)
    assert torch.equal(first_loaded, saved) and torch.equal(last_loaded, saved)
    assert torch.equal(first_next, last_next) and not torch.equal(first_next, saved)
