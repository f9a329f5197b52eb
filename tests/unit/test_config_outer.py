"""Config rules of outer-loop data parallelism (``parallel.dp_mode``: DiLoCo, NoLoCo, CO2): bad
values and the layouts not built yet are refused by name; the built ones resolve."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, job_of, load_config, resolve


def resolved(world: int, **overrides):
    return resolve(load_config(None, {"model.preset": "debug", **overrides}), world)


DILOCO = {"parallel.dp_mode": "diloco"}


@pytest.mark.parametrize("overrides, world, field, words", [
    # an outer mode needs replicas to merge
    (DILOCO, 1, "parallel.dp_mode", "dp_replicate >= 2"),
    ({**DILOCO, "parallel.dp_replicate": "1", "parallel.dp_shard": "2"}, 2, "parallel.dp_mode",
     "dp_replicate = 1"),
    ({"parallel.dp_mode": "noloco", "parallel.dp_replicate": "1", "parallel.tp": "2",
      "model.n_kv_heads": "4"}, 2, "parallel.dp_mode", "dp_replicate >= 2"),
    ({"parallel.dp_mode": "fedavg"}, 2, "parallel.dp_mode", "must be one of sync, diloco"),
    # the outer optimizer's knobs, whatever the mode
    ({**DILOCO, "parallel.outer_steps": "0"}, 2, "parallel.outer_steps", "must be >= 1"),
    ({"parallel.outer_steps": "-3"}, 2, "parallel.outer_steps", "must be >= 1"),
    ({**DILOCO, "parallel.outer_lr": "0"}, 2, "parallel.outer_lr", "must be > 0"),
    ({**DILOCO, "parallel.outer_lr": "-0.7"}, 2, "parallel.outer_lr", "must be > 0"),
    ({**DILOCO, "parallel.outer_momentum": "-0.1"}, 2, "parallel.outer_momentum", "[0, 1)"),
    ({**DILOCO, "parallel.outer_momentum": "1"}, 2, "parallel.outer_momentum", "[0, 1)"),
    ({**DILOCO, "parallel.outer_fragments": "0"}, 2, "parallel.outer_fragments", ">= 1"),
    ({"parallel.dp_mode": "co2", "parallel.co2_clip": "-1"}, 2, "parallel.co2_clip", ">= 0"),
    ({"parallel.dp_mode": "co2", "parallel.co2_gap_penalty": "-0.5"}, 2,
     "parallel.co2_gap_penalty", ">= 0"),
    ({"parallel.dp_mode": "noloco", "parallel.noloco_consensus": "-1"}, 2,
     "parallel.noloco_consensus", ">= 0"),
    ({"parallel.outer_lr": "nan"}, 2, "parallel.outer_lr", "finite"),
    ({**DILOCO, "train.post_validation": "true"}, 2, "train.post_validation", "dp_mode = diloco"),
    # streaming: diloco only, and a fragment per inner step of the window at most
    ({"parallel.dp_mode": "noloco", "parallel.outer_fragments": "2"}, 2,
     "parallel.outer_fragments", "diloco only"),
    ({**DILOCO, "parallel.outer_steps": "2", "parallel.outer_fragments": "3"}, 2,
     "parallel.outer_fragments", "<= parallel.outer_steps = 2"),
    # not built yet, refused with the reason
    ({**DILOCO, "parallel.dp_shard": "2", "parallel.zero_stage": "2",
      "train.offload_optimizer": "true"}, 4, "train.offload_optimizer", "on the host"),
])
def test_rules(overrides, world, field, words):
    with pytest.raises(ConfigError) as err:
        resolved(world, **overrides)
    assert err.value.field_name == field and words in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, world", [
    ({}, 2),  # sync, the default
    (DILOCO, 2),
    ({"parallel.dp_mode": "noloco", "parallel.outer_steps": "1"}, 4),
    ({"parallel.dp_mode": "co2", "parallel.co2_clip": "0.01", "parallel.co2_gap_penalty": "0"},
     2),
    ({**DILOCO, "parallel.outer_steps": "4", "parallel.outer_fragments": "4"}, 2),
    ({**DILOCO, "parallel.outer_momentum": "0"}, 2),
    # inside a replica: ZeRO-3, tp, pp, cp
    ({**DILOCO, "parallel.dp_shard": "2", "parallel.dp_replicate": "2"}, 4),
    ({**DILOCO, "parallel.tp": "2", "model.n_kv_heads": "4"}, 4),
    ({**DILOCO, "parallel.pp": "2"}, 4),
    # ep with ZeRO on the replica's own meshes (tests/dist/test_outer_trainer.py)
    ({**DILOCO, "model.preset": "tiny-moe", "parallel.ep": "2", "parallel.dp_shard": "2",
      "parallel.zero_stage": "3", "train.micro_batch_size": "1"}, 8),
    ({**DILOCO, "parallel.cp": "2"}, 4),
    # an MoE model without expert parallelism: its experts are ordinary parameters
    ({**DILOCO, "model.preset": "tiny-moe"}, 2),
    # expert parallelism inside each replica (tests/dist/test_outer_trainer.py), documents
    # under cp too
    ({**DILOCO, "model.preset": "tiny-moe", "parallel.ep": "2"}, 4),
    # ZeRO-1/2: each rank merges the slices its optimizer owns
    ({**DILOCO, "parallel.dp_shard": "2", "parallel.zero_stage": "1"}, 4),
    ({**DILOCO, "parallel.dp_shard": "2", "parallel.zero_stage": "2"}, 4),
    ({**DILOCO, "parallel.cp": "2", "data.packing": "pack"}, 4),
])
def test_built_layouts_resolve(overrides, world):
    config = resolved(world, **overrides)
    assert job_of(config).dp_mode == config.parallel.dp_mode


def test_dp_mode_defaults_to_sync_and_outer_knobs_to_diloco_paper_values():
    par = resolved(2).parallel
    assert (par.dp_mode, par.outer_steps, par.outer_lr, par.outer_momentum,
            par.outer_fragments) == ("sync", 8, 0.7, 0.9, 1)
