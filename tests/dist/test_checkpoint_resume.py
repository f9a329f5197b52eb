"""Checkpoints through the Trainer: resuming is bit-exact, and a checkpoint saved under one layout
loads under another with bit-identical weights and optimizer state (DCP reshards by name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.config import from_dict, resolve
from loom.train.resume_checks import model_shape_refusal
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

STEPS = 4
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0}

LAYOUTS = {  # name -> (world size, parallel degrees and schedule)
    "single": (1, {}),
    "dp2": (2, {"dp_replicate": 2}),
    "pp2-interleaved": (2, {"pp": 2, "schedule": "interleaved_1f1b", "chunks": 2}),
    "pp2-zbv": (2, {"pp": 2, "schedule": "zbv"}),
    "pp2xdp2": (4, {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}),
    "zero3-dp2": (2, {"dp_shard": 2, "zero_stage": 3}),
    "hsdp-2x2": (4, {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}),
    "tp2-sp-dp2": (4, {"tp": 2, "sequence_parallel": True, "dp_replicate": 2}),
    "cp2": (2, {"cp": 2}),
    "zero1-dp2": (2, {"dp_shard": 2, "zero_stage": 1}),
    "zero2-dp2": (2, {"dp_shard": 2, "zero_stage": 2}),
    "zero2-hsdp-2x2": (4, {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 2}),
    "pp2-zero3-dp2": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 3, "schedule": "1f1b"}),
    # the 8-rank combination: every kind of axis at once, multi-chunk schedule
    "pp2xtp2xdp2-8rank": (8, {"pp": 2, "tp": 2, "sequence_parallel": True, "dp_replicate": 2,
                              "schedule": "interleaved_1f1b", "chunks": 2}),
}


def config_for(layout: str) -> dict:
    world, parallel = LAYOUTS[layout]
    return layout_config(BASE, world, **parallel)


def _full_state(trainer) -> dict:
    """Model and optimizer state (tensors and hyper-parameters) of the whole model, by name, on
    every rank (gathered: DTensors, ZeRO-1/2 slices and expert shards become full tensors)."""
    from loom.train.checkpointing import checkpoint_tensors
    from loom.train.checkpoint_state import gather_full

    return gather_full(checkpoint_tensors(trainer))


def train_straight(ctx, config_table, data_dir, steps):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(steps):
        trainer.train_step()
    state = _full_state(trainer)  # a collective: every rank gathers
    return state if ctx.rank == 0 else None


def train_stop_resume(ctx, config_table, data_dir, run_dir, steps):
    from loom.train.trainer import Trainer

    first = Trainer(from_dict(config_table), data_dir, run_dir, ctx)
    for _ in range(steps // 2):
        first.train_step()
    first.save_checkpoint()
    del first
    return resume_and_finish(ctx, config_table, data_dir, run_dir, steps)


def resume_and_finish(ctx, config_table, data_dir, run_dir, steps):
    """A new Trainer resumes the run's newest checkpoint (of step ``steps // 2``) and trains to
    ``steps``; returns the full state (rank 0)."""
    from loom.train.trainer import Trainer

    second = Trainer(from_dict(config_table), data_dir, run_dir, ctx)
    second.resume("auto", log=lambda msg: None)
    assert second.step == steps // 2
    while second.step < steps:
        second.train_step()
    state = _full_state(second)
    return state if ctx.rank == 0 else None


def save_after(ctx, config_table, data_dir, root, steps):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(steps):
        trainer.train_step()
    path = trainer.save_checkpoint(root)
    state = _full_state(trainer)
    return (str(path), state) if ctx.rank == 0 else None



def state_after_load(ctx, config_table, data_dir, path):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.load_checkpoint(path)
    state = _full_state(trainer)
    return (trainer.step, state) if ctx.rank == 0 else None


def offloaded(ctx, fn, *args):
    """``fn(ctx, *args)`` with ZeRO-1/2's optimizer-offload path (host copies of the slices)
    forced on, which ``plan_offload`` turns off on a CPU device: the logic runs, not the benefit."""
    from loom.parallel import zero

    original = zero.ZeroShardedOptimizer.__init__
    zero.ZeroShardedOptimizer.__init__ = \
        lambda self, *a, **kw: original(self, *a, **{**kw, "offload": True})
    try:
        return fn(ctx, *args)
    finally:
        zero.ZeroShardedOptimizer.__init__ = original


def assert_equal_states(got: dict, expected: dict, label: str) -> None:
    assert set(got) == set(expected), f"{label}: {sorted(set(got) ^ set(expected))[:5]}"
    for name, value in expected.items():
        same = torch.equal(got[name], value) if torch.is_tensor(value) else got[name] == value
        assert same, f"{label}: {name} differs"


# matrix: pp x tp x dp (resumed under vocab-pp x tp in test_pipeline_vocab_tp.py), tp-SP x dp
# (ZeRO-2's tp-SP resume in test_zero_compose.py), and the cases whose state another CI case
# holds: ZeRO-2's flat slices (zero2-hsdp-2x2 resumes them), a pipeline inside dp
# (pp2-zero3-dp2), a multi-chunk pipeline (pp2-zbv's V; pp2-interleaved reshards below)
RESUMES_IN_MATRIX = ("pp2xtp2xdp2-8rank", "tp2-sp-dp2", "hsdp-2x2", "zero2-dp2", "pp2xdp2",
                     "pp2-interleaved")


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[name for name in LAYOUTS
                                                       if name not in RESUMES_IN_MATRIX]))
def test_stop_and_resume_is_bit_exact(dist, small_data_dir, tmp_path, layout):
    check_resume(dist, small_data_dir, tmp_path, LAYOUTS[layout][0], config_for(layout), layout)


def check_resume(dist, data_dir, run_dir, world: int, config: dict, label: str,
                 stop_resume=train_stop_resume, steps: int = STEPS) -> None:
    """A run stopped halfway and resumed ends bit-identical to one that never stopped."""
    straight = dist.run(world, train_straight, config, data_dir, steps)[0]
    resumed = dist.run(world, stop_resume, config, data_dir, str(run_dir), steps)[0]
    assert_equal_states(resumed, straight, f"{label} resumed vs straight")


# ZeRO-1 -> ZeRO-3 runs inside a pipeline (zero1-dp2 -> pp2-zero3-dp2), ZeRO-2 slices as a
# source in zero2-hsdp-2x2 -> zero1-dp2; their plain twins run in the matrix
RESHARDS_IN_CI = [("pp2-interleaved", "dp2"), ("zero3-dp2", "pp2-zbv"), ("dp2", "hsdp-2x2"),
                  ("tp2-sp-dp2", "pp2-zbv"), ("cp2", "zero3-dp2"),
                  ("zero2-hsdp-2x2", "zero1-dp2"),
                  ("pp2-zero3-dp2", "single"), ("zero1-dp2", "pp2-zero3-dp2")]


@pytest.mark.parametrize("source, target", matrix([("dp2", "single"), ("pp2-interleaved", "dp2"),
                                            ("pp2xdp2", "pp2-zbv"), ("single", "pp2xdp2"),
                                            ("zero3-dp2", "single"), ("zero3-dp2", "pp2-zbv"),
                                            ("dp2", "hsdp-2x2"), ("tp2-sp-dp2", "pp2-zbv"),
                                            ("pp2xdp2", "tp2-sp-dp2"), ("cp2", "zero3-dp2"),
                                            # ZeRO-1/2: flat slices saved as per-name boxes
                                            ("zero1-dp2", "dp2"), ("dp2", "zero1-dp2"),
                                            ("zero1-dp2", "zero3-dp2"), ("zero3-dp2", "zero2-dp2"),
                                            ("zero2-dp2", "single"), ("pp2-zbv", "zero2-dp2"),
                                            ("zero2-hsdp-2x2", "zero1-dp2"),
                                            ("zero1-dp2", "zero2-hsdp-2x2"),
                                            # ZeRO-3 inside pipeline stages
                                            ("pp2-zero3-dp2", "single"),
                                            ("zero1-dp2", "pp2-zero3-dp2")],
                                                   ci=RESHARDS_IN_CI))
def test_a_checkpoint_reshards_to_another_layout(dist, small_data_dir, tmp_path, source, target):
    check_reshard(dist, small_data_dir, tmp_path, (LAYOUTS[source][0], config_for(source)),
                  (LAYOUTS[target][0], config_for(target)), f"{source} -> {target}")


# (world, config, data) -> (checkpoint path, full state) of ``save_after``, 2 steps. Many reshard
# cases, here and in the files that import check_reshard, start from the same source layout; the
# checkpoint is only read afterwards, so each source trains and saves once per session.
_SAVED: dict[str, tuple[str, dict]] = {}


def saved_checkpoint(dist, data_dir, root, source) -> tuple[str, dict]:
    """``save_after(source, 2 steps)`` into ``root``, or the same source's earlier result."""
    key = json.dumps([source[0], source[1], str(data_dir)], sort_keys=True, default=str)
    if key not in _SAVED:
        _SAVED[key] = dist.run(source[0], save_after, source[1], data_dir, str(root), 2)[0]
    return _SAVED[key]


def check_reshard(dist, data_dir, root, source, target, label: str) -> None:
    """Save after 2 steps under ``source`` = (world, config table), load under ``target``: the
    same step, and bit-identical weights and optimizer state. ``loom train``'s check before the
    launch (``model_shape_refusal``) accepts the checkpoint for the target's model."""
    path, saved = saved_checkpoint(dist, data_dir, root, source)
    assert model_shape_refusal(resolve(from_dict(target[1]), target[0]), Path(path)) is None
    step, loaded = dist.run(target[0], state_after_load, target[1], data_dir, path)[0]
    assert step == 2, label
    assert_equal_states(loaded, saved, label)


def test_zero2_with_offloaded_slices_resumes_bit_exact(dist, small_data_dir, tmp_path):
    """The host copy of each slice is refreshed from the loaded weights on load."""
    config = config_for("zero2-dp2")
    straight = dist.run(2, offloaded, train_straight, config, small_data_dir, STEPS)[0]
    resumed = dist.run(2, offloaded, train_stop_resume, config, small_data_dir, str(tmp_path),
                       STEPS)[0]
    assert_equal_states(resumed, straight, "zero2-dp2 offloaded: resumed vs straight")
