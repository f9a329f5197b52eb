"""The shipped recipes (configs/llama3-8b-*.toml) are planner output that Loom's own rules accept
at their cluster's size, keep their training settings, and say what is still to set."""

from pathlib import Path

import pytest

from loom.config import load_config, resolve
from loom.plan.explain import still_to_set

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
RECIPES = {"llama3-8b-continued-pretraining.toml": (64, 1e-4, 8192),
           "llama3-8b-finetune.toml": (8, 2e-5, 4096)}


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_is_a_valid_config_for_its_cluster(name):
    world, lr, seq_len = RECIPES[name]
    config = resolve(load_config(CONFIGS / name), world)
    assert config.model.dim == 4096 and config.model.n_layers == 32  # the Llama-3-8B shape
    assert config.optim.lr == lr and config.data.seq_len == seq_len  # the input's settings
    text = (CONFIGS / name).read_text()
    assert "# still to set before training:" in text
    for line in still_to_set(config):
        assert f"#   {line}" in text
    inputs = load_config(CONFIGS / "plan-inputs" / name)
    assert inputs.train.steps == config.train.steps and inputs.optim.lr == lr
