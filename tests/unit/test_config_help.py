"""Specifications for loom.config_help: every config key is described, from its field's comment."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from loom.config import ModelConfig, known_keys
from loom.config_help import field_description, help_text, key_descriptions, missing_descriptions

SAMPLE = '''
from dataclasses import dataclass


@dataclass
class Base:
    inherited: int = 1  # described where it is declared


@dataclass
class Sample(Base):
    """A docstring is not a comment."""

    alone: int = 0  # a trailing comment
    # a block above a field,
    # two lines long
    blocked: int = 1
    follows: int = 2
    own: int = 3  # its own comment wins over the block above the run
    still_in_run: int = 4

    after_blank: int = 5
    inherited: int = 6  # redeclared, with its own comment
    # the block of a run
    multi_line: tuple = (
        1,
        2,
    )  # and the trailing comment of its last line
    bare: int = 7
'''


@pytest.fixture
def sample(tmp_path, monkeypatch):
    path = tmp_path / "sample_config.py"
    path.write_text(textwrap.dedent(SAMPLE))
    spec = importlib.util.spec_from_file_location("sample_config", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sample_config", module)
    spec.loader.exec_module(module)
    return module


def test_the_comment_rules(sample) -> None:
    got = {name: field_description(sample.Sample, name)
           for name in ("alone", "blocked", "follows", "own", "still_in_run", "after_blank",
                        "inherited", "multi_line", "bare")}
    assert got == {
        "alone": "a trailing comment",
        "blocked": "a block above a field, two lines long",
        "follows": "a block above a field, two lines long",  # a run of fields shares the block
        "own": "its own comment wins over the block above the run",
        "still_in_run": "a block above a field, two lines long",
        "after_blank": "",  # a blank line ends the run
        "inherited": "redeclared, with its own comment",
        "multi_line": "and the trailing comment of its last line",
        "bare": "the block of a run",  # the run goes on past a field with its own comment
    }
    assert field_description(sample.Base, "inherited") == "described where it is declared"


def test_every_config_key_has_a_description() -> None:
    """Add a comment next to a new config field (the rules are in loom/config_help.py)."""
    assert list(key_descriptions()) == known_keys()
    assert missing_descriptions() == []


def test_inherited_model_fields_are_described_where_they_are_declared() -> None:
    assert field_description(ModelConfig, "dim") == "model width h (the residual stream)"
    assert "tokenizer's vocabulary" in field_description(ModelConfig, "vocab_size")  # redeclared


def test_help_lists_every_section_and_key_with_its_default_and_description() -> None:
    text = help_text()
    sections = [line for line in text.splitlines() if line.startswith("[")]
    assert [s.split("]")[0] + "]" for s in sections] == [
        "[model]", "[parallel]", "[train]", "[optim]", "[data]", "[checkpoint]", "[metrics]",
        "[fault]"]
    body = text.split("\n[train]\n", 1)[1].split("\n[optim]\n", 1)[0]
    assert body.startswith("  steps = 200\n      optimizer steps to train\n")
    assert '\n  dtype = "fp32"  (fp32 | bf16 | bf16_autocast)\n' in body
    for key, description in key_descriptions().items():
        section, name = key.split(".")
        block = text.split(f"\n[{section}]", 1)[1].split("\n[", 1)[0]
        assert f"\n  {name} = " in block, key
        assert " ".join(description.split()[:4]) in " ".join(block.split()), key
