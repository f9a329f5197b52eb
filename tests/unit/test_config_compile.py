"""Config of ``train.compile`` (torch.compile per transformer block): the key, its way into the
builders' ``Job``, the combinations it refuses (by field and rule) and those it allows."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, job_of, load_config, resolve


def resolved(world: int, **overrides):
    return resolve(load_config(None, {"model.preset": "debug", **overrides}), world)


def test_compile_is_off_by_default_and_reaches_the_job():
    assert not resolved(1).train.compile and not job_of(resolved(1)).compile
    config = resolved(1, **{"train.compile": "true"})
    assert config.train.compile and job_of(config).compile


@pytest.mark.parametrize("overrides, world, field, words", [
    ({"metrics.comm": "true", "parallel.tp": "2", "model.n_kv_heads": "4"}, 2, "metrics.comm",
     "TorchDispatchMode"),
    ({"train.compile": "maybe"}, 1, "train.compile", ""),
])
def test_refused(overrides, world, field, words):
    with pytest.raises(ConfigError) as err:
        resolved(world, **{"train.compile": "true", **overrides})
    assert err.value.field_name == field and words in str(err.value)


@pytest.mark.parametrize("overrides, world", [  # tests/dist/test_compile_parity.py runs these
    ({"parallel.dp_shard": "2"}, 2),
    ({"parallel.tp": "2", "model.n_kv_heads": "4"}, 2),
    ({"parallel.tp": "2", "model.n_kv_heads": "4", "parallel.sequence_parallel": "true"}, 2),
    ({"parallel.pp": "2"}, 2),
    ({"train.recompute": "full"}, 1),
    ({"metrics.comm": "true", "parallel.dp_shard": "2"}, 2),  # counted outside the blocks
    ({"parallel.cp": "2", "parallel.cp_mode": "ulysses"}, 2),
    ({"model.n_experts": "4"}, 1),  # the MoE layer eager, the rest of the block compiled
    ({"model.n_experts": "4", "parallel.ep": "2"}, 2),
])
def test_allowed(overrides, world):
    assert resolved(world, **{"train.compile": "true", **overrides}).train.compile
