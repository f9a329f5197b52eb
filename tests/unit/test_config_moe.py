"""Config rules for mixture-of-experts models: what composes with MoE, and what is still refused
by name (``loom.config_rules._validate_experts``)."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, load_config, resolve

MOE = {"model.preset": "tiny-moe"}


def _resolve(overrides: dict, world: int):
    return resolve(load_config(None, {**MOE, **overrides}), world)


@pytest.mark.parametrize("overrides, world", [
    ({"parallel.tp": 2}, 2),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True}, 2),
    ({"parallel.ep": 2, "parallel.tp": 2}, 4),
    ({"parallel.ep": 2, "parallel.tp": 2, "parallel.dp_replicate": 2}, 8),
    ({"parallel.pp": 2}, 2),
    ({"parallel.pp": 2, "parallel.ep": 2, "parallel.schedule": "zbv"}, 4),
    # checkpoints of pp x ep: tests/dist/test_checkpoint_experts.py (pp2-ep2)
    ({"parallel.pp": 2, "parallel.ep": 2, "checkpoint.interval": 1}, 4),
    # pp x tp: tests/dist/test_expert_pipeline.py (pp2-tp2, with and without SP)
    ({"parallel.pp": 2, "parallel.tp": 2}, 4),
    ({"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}, 4),
    # cp (dropless): tests/dist/test_expert_context.py
    ({"parallel.cp": 2}, 2),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses"}, 2),
    ({"parallel.cp": 2, "parallel.ep": 2}, 4),
    ({"parallel.cp": 2, "parallel.tp": 2}, 4),
    ({"parallel.cp": 2, "parallel.pp": 2}, 4),
])
def test_moe_with_tensor_pipeline_or_context_parallelism_is_accepted(overrides, world) -> None:
    config = _resolve(overrides, world)
    degrees = config.parallel.degrees()
    assert degrees["pp"] * degrees["tp"] * degrees["cp"] in (2, 4)


@pytest.mark.parametrize("overrides, world", [
    # parity: tests/dist/test_zero_expert.py (dp_shard2 with ep 1 and 2, HSDP x ep2)
    ({"parallel.dp_shard": 2, "parallel.zero_stage": 1}, 2),
    ({"parallel.dp_shard": 2, "parallel.zero_stage": 3}, 2),
    ({"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero_stage": 2}, 4),
    ({"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.dp_replicate": 2,
      "train.micro_batch_size": 1}, 8),
    ({"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.zero_stage": 3}, 4),
    ({"parallel.dp_shard": 2, "parallel.cp": 2, "parallel.zero_stage": 2}, 4),
    ({"parallel.dp_shard": 2, "parallel.pp": 2, "parallel.schedule": "zbv",
      "parallel.zero_stage": 2}, 4),
    ({"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.zero_stage": 1}, 8),
    ({"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.pp": 2, "parallel.zero_stage": 3}, 8),
    ({"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.cp": 2, "parallel.zero_stage": 3}, 8),
])
def test_moe_with_zero_is_accepted(overrides, world) -> None:
    assert _resolve(overrides, world).parallel.dp_shard == 2


@pytest.mark.parametrize("overrides, world, field, words", [
    # expert-TP = TP splits every expert's hidden dim (expert_ffn_dim, else ffn_dim)
    ({"parallel.tp": 2, "model.expert_ffn_dim": 63}, 2, "model.expert_ffn_dim",
     ["must be divisible by parallel.tp = 2", "expert-TP", "nearest valid: 62 or 64"]),
    ({"parallel.tp": 2, "model.expert_ffn_dim": 0, "model.ffn_dim": 129}, 2, "model.ffn_dim",
     ["must be divisible by parallel.tp = 2"]),
    # still refused, each naming its rule
    ({"parallel.cp": 2, "model.capacity_factor": 1.0}, 2, "model.capacity_factor",
     ["must be 0 (dropless) with parallel.cp = 2", "queue position", "cp splits"]),
    ({"parallel.ep": 3}, 3, "model.n_experts", ["must be divisible by parallel.ep", "= 3"]),
])
def test_moe_combinations_refused_by_name(overrides, world, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(overrides, world)
    assert info.value.field_name == field, str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)
