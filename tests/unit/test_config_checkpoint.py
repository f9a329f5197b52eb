"""Config of checkpoints: expert-parallel layouts, whose checkpoints were refused before, resolve
with checkpointing on (ZeRO-1/2's cases are in test_config_zero.py), and
``checkpoint.async_save`` parses."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, load_config, resolve


def resolved(world: int, **overrides):
    return resolve(load_config(None, {"model.preset": "debug", **overrides}), world)


@pytest.mark.parametrize("overrides, world", [
    ({"model.preset": "tiny-moe", "parallel.ep": "2", "parallel.dp_replicate": "1",
      "checkpoint.interval": "5"}, 2),
    ({"model.preset": "tiny-moe", "parallel.ep": "4", "parallel.dp_replicate": "1",
      "checkpoint.resume": "auto"}, 4),
])
def test_checkpointing_layouts_resolve(overrides, world):
    resolved(world, **overrides)


def test_async_save_is_off_by_default_and_parses():
    assert resolved(1).checkpoint.async_save is False
    assert resolved(1, **{"checkpoint.async_save": "true"}).checkpoint.async_save is True
    with pytest.raises(ConfigError):
        resolved(1, **{"checkpoint.async_save": "sometimes"})
