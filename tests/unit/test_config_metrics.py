"""Specifications for the ``[metrics]`` keys of loom train's everyday tools: the profiled steps,
the stated MFU peak and the W&B tracker, how they parse and how a bad value is refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from loom.config import ConfigError, load_config, resolve, to_toml


def resolved(overrides: dict[str, object], path: Path | None = None):
    return resolve(load_config(path, overrides), 1)


def refusal(overrides: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        resolved(overrides)
    return str(info.value)


def test_profile_steps_from_the_command_line_or_a_toml_array(tmp_path: Path) -> None:
    assert resolved({"metrics.profile_steps": "2,4"}).metrics.profile_steps == (2, 4)
    assert resolved({"metrics.profile_steps": "3"}).metrics.profile_steps == (3,)
    assert resolved({"metrics.profile_steps": ""}).metrics.profile_steps == ()
    path = tmp_path / "c.toml"
    path.write_text("[metrics]\nprofile_steps = [5, 7]\n")
    config = resolved({}, path)
    assert config.metrics.profile_steps == (5, 7)
    path.write_text(to_toml(config))  # what the run directory keeps reads back the same
    assert resolved({}, path) == config


@pytest.mark.parametrize("value", ["a,2", "2.5", [True], [1.0, 2]])
def test_profile_steps_must_be_integers(value: object) -> None:
    assert "metrics.profile_steps" in refusal({"metrics.profile_steps": value})
    assert "must be a list of integers" in refusal({"metrics.profile_steps": value})


@pytest.mark.parametrize("value", ["0", "0,3", "4,2", "3,11", "11", "1,2,3"])
def test_profile_steps_must_be_a_range_inside_the_run(value: str) -> None:
    message = refusal({"metrics.profile_steps": value, "train.steps": 10})
    assert message.startswith(f"config error: metrics.profile_steps='{value}': must be A,B")
    assert "1 <= A <= B <= train.steps = 10" in message


def test_profile_steps_at_the_edges_of_the_run() -> None:
    assert resolved({"metrics.profile_steps": "1,10", "train.steps": 10})
    assert resolved({"metrics.profile_steps": "10", "train.steps": 10})


def test_peak_tflops_must_not_be_negative() -> None:
    assert "metrics.peak_tflops=-1.0: must be >= 0" in refusal({"metrics.peak_tflops": "-1"})
    assert resolved({"metrics.peak_tflops": "989"}).metrics.peak_tflops == 989.0


def test_wandb_without_the_package_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec then reports it missing
    message = refusal({"metrics.wandb": "true"})
    assert message.startswith("config error: metrics.wandb=True: needs the wandb package")
    assert "pip install 'loom[wandb]'" in message
    assert resolved({"metrics.wandb": "false"}).metrics.wandb is False  # off: no package needed


def test_wandb_needs_a_project(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if installed, whether it is or not
                        lambda name, *a: object() if name == "wandb" else real(name, *a))
    assert resolved({"metrics.wandb": "true"}).metrics.wandb_project == "loom"
    assert "metrics.wandb_project=' ': must name a W&B project" in refusal(
        {"metrics.wandb": "true", "metrics.wandb_project": " "})
