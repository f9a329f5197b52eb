"""Config rules of ZeRO / FSDP, recomputation, offload and the memory limit."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, load_config, resolve


def resolved(world: int, **overrides):
    return resolve(load_config(None, {"model.preset": "debug", **overrides}), world)


def test_dp_shard_defaults_to_zero3_and_is_part_of_dp():
    config = resolved(4, **{"parallel.dp_shard": "2"})
    assert config.parallel.zero_stage == 3 and config.parallel.dp == 4
    assert config.parallel.reshard_after_forward


@pytest.mark.parametrize("overrides, world, field, words", [
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "4"}, 2, "parallel.zero_stage",
     "must be 1, 2 or 3"),
    ({"train.recompute_every": "0"}, 1, "train.recompute_every", ">= 1"),
    ({"train.recompute": "some"}, 1, "train.recompute", "must be one of"),
    ({"train.offload_optimizer": "true"}, 1, "train.offload_optimizer", "dp_shard > 1"),
    ({"train.memory_limit_gb": "-1"}, 1, "train.memory_limit_gb", ">= 0"),
    ({"train.grad_reduce_dtype": "fp16"}, 1, "train.grad_reduce_dtype", "fp32, bf16"),
    ({"train.grad_bucket_mb": "0"}, 1, "train.grad_bucket_mb", "must be > 0"),
    ({"train.grad_reduce_every_microbatch": "true"}, 1, "train.grad_reduce_every_microbatch",
     "dp_shard > 1 with zero_stage = 2 or 3"),
    ({"train.grad_reduce_every_microbatch": "true", "parallel.dp_shard": "2",
      "parallel.zero_stage": "1"}, 2, "train.grad_reduce_every_microbatch", "zero_stage = 2 or 3"),
    ({"train.grad_reduce_every_microbatch": "true", "parallel.dp_shard": "2",
      "parallel.zero_stage": "2", "parallel.pp": "2"}, 4, "train.grad_reduce_every_microbatch",
     "not with pp > 1"),
])
def test_rules(overrides, world, field, words):
    with pytest.raises(ConfigError) as err:
        resolved(world, **overrides)
    assert err.value.field_name == field and words in str(err.value)


@pytest.mark.parametrize("overrides, world", [
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "1"}, 2),
    # ZeRO-1/2 checkpoints save the flat slices as per-parameter boxes (checkpoint_state.py)
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "2", "checkpoint.interval": "5"}, 2),
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "1", "checkpoint.resume": "auto"}, 2),
    ({"parallel.dp_shard": "2", "parallel.dp_replicate": "2"}, 4),
    ({"parallel.dp_shard": "2", "parallel.tp": "2", "model.n_kv_heads": "4"}, 4),
    # ZeRO-1/2 bucket each rank's tp shards (tests/dist/test_zero_compose.py)
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "1", "parallel.tp": "2"}, 4),
    ({"parallel.dp_shard": "2", "parallel.pp": "2", "parallel.tp": "2"}, 8),
    ({"parallel.dp_shard": "2", "train.offload_optimizer": "true"}, 2),
    # ZeRO shards over dp_shard x cp (tests/dist/test_zero_compose.py)
    ({"parallel.dp_shard": "2", "parallel.cp": "2", "parallel.cp_mode": "ring"}, 4),
    ({"parallel.dp_shard": "2", "parallel.cp": "2", "parallel.zero_stage": "2"}, 4),
    # ZeRO-1/2 inside pipeline stages, also with I/W-split schedules (parameters stay whole)
    ({"parallel.dp_shard": "2", "parallel.pp": "2", "parallel.zero_stage": "1"}, 4),
    ({"parallel.dp_shard": "2", "parallel.pp": "2", "parallel.zero_stage": "2",
      "parallel.schedule": "zbv", "train.global_batch_size": "8"}, 4),
    ({"train.recompute": "every_k", "train.recompute_every": "3"}, 1),
])
def test_valid_layouts(overrides, world):
    resolved(world, **overrides)
