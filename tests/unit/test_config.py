"""Specifications for loom.config: what a valid config is, and how every invalid one is refused.

A refused config raises ``ConfigError`` whose message reads ``config error: FIELD=VALUE: RULE``.
Each rejection case below names the field, the value (as it appears in the message) and the words
of the rule, so the table is also the list of rules the user can run into.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom.config import (Config, ConfigError, from_dict, load_config, parse_overrides, resolve,
                         to_dict, to_toml)
from loom.models import PRESETS

torch.set_num_threads(1)


def config_error(overrides: dict[str, object] | None = None, world_size: int = 1,
                 path: Path | str | None = None) -> ConfigError:
    """The ConfigError raised while loading and resolving; fails the test if none is raised."""
    with pytest.raises(ConfigError) as info:
        resolve(load_config(path, overrides), world_size)
    return info.value


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# Rejections from overrides (values arrive as command-line strings, as from `loom train`).
#
# Columns: overrides, world size, the field named, "field=value" as printed, words of the rule.

REJECTED = [
    # Unknown names, with the nearest known one suggested.
    ({"train.setps": "5"}, 1, "train.setps", "train.setps='5'",
     ["unknown key", "did you mean 'train.steps'"]),
    ({"model.dimm": "64"}, 1, "model.dimm", "model.dimm='64'",
     ["unknown key", "did you mean 'model.dim'"]),
    ({"trian.steps": "5"}, 1, "trian.steps", "trian.steps='5'",
     ["unknown section", "did you mean 'train'"]),
    ({"model.preset": "llama3-7b"}, 1, "model.preset", "model.preset='llama3-7b'",
     ["unknown preset", "llama3-8b"]),
    # Wrong types.
    ({"train.steps": "five"}, 1, "train.steps", "train.steps='five'", ["must be an integer"]),
    ({"train.steps": "2.5"}, 1, "train.steps", "train.steps='2.5'", ["must be an integer"]),
    ({"optim.lr": "fast"}, 1, "optim.lr", "optim.lr='fast'", ["must be a number"]),
    ({"metrics.jsonl": "maybe"}, 1, "metrics.jsonl", "metrics.jsonl='maybe'",
     ["must be a boolean"]),
    ({"train.dtype": "fp16"}, 1, "train.dtype", "train.dtype='fp16'",
     ["must be one of fp32, bf16", "did you mean"]),
    ({"data.tokenizer": "wordpiece"}, 1, "data.tokenizer", "data.tokenizer='wordpiece'",
     ["must be one of byte, bpe"]),
    # Values out of range.
    ({"train.steps": "0"}, 1, "train.steps", "train.steps=0", ["must be >= 1"]),
    ({"model.dim": "-64"}, 1, "model.dim", "model.dim=-64", ["must be >= 1"]),
    ({"train.micro_batch_size": "0"}, 1, "train.micro_batch_size", "train.micro_batch_size=0",
     ["must be >= 1"]),
    ({"train.eval_every": "-1"}, 1, "train.eval_every", "train.eval_every=-1", ["must be >= 0"]),
    ({"optim.weight_decay": "-0.1"}, 1, "optim.weight_decay", "optim.weight_decay=-0.1",
     ["must be >= 0"]),
    ({"optim.lr": "0"}, 1, "optim.lr", "optim.lr=0.0", ["must be > 0"]),
    ({"optim.min_lr_ratio": "1.5"}, 1, "optim.min_lr_ratio", "optim.min_lr_ratio=1.5",
     ["must be in [0, 1]"]),
    ({"optim.beta1": "1.0"}, 1, "optim.beta1", "optim.beta1=1.0", ["must be in [0, 1)"]),
    ({"optim.beta2": "-0.5"}, 1, "optim.beta2", "optim.beta2=-0.5", ["must be in [0, 1)"]),
    ({"data.val_fraction": "0"}, 1, "data.val_fraction", "data.val_fraction=0.0",
     ["must be in (0, 1)"]),
    ({"data.val_fraction": "1.5"}, 1, "data.val_fraction", "data.val_fraction=1.5",
     ["must be in (0, 1)"]),
    ({"data.source": "/no/such/corpus"}, 1, "data.source", "data.source='/no/such/corpus'",
     ["does not exist", "use 'stdlib' or an existing text file or directory"]),
    ({"data.tokenizer": "bpe", "data.bpe_vocab_size": "258"}, 1, "data.bpe_vocab_size",
     "data.bpe_vocab_size=258", ["must be >= 260"]),
    ({"train.backend": "mpi"}, 1, "train.backend", "train.backend='mpi'",
     ["must be one of auto, gloo, nccl"]),
    ({"train.max_skipped_steps": "-1"}, 1, "train.max_skipped_steps",
     "train.max_skipped_steps=-1", ["must be >= 0"]),
    ({"train.backend": "nccl", "train.device": "cpu"}, 1, "train.backend",
     "train.backend='nccl'", ["nccl needs a GPU device"]),
    ({"train.device": "tpu"}, 1, "train.device", "train.device='tpu'",
     ["must be auto, cpu, cuda or cuda:N"]),
    # Model shape.
    ({"model.dim": "100"}, 1, "model.dim", "model.dim=100",
     ["must be divisible by model.n_heads = 8", "nearest valid: 96 or 104"]),
    ({"model.dim": "24"}, 1, "model.dim", "model.dim=24",
     ["dim / n_heads = 3 must be even", "RoPE"]),
    ({"model.n_kv_heads": "3"}, 1, "model.n_heads", "model.n_heads=8",
     ["must be divisible by model.n_kv_heads = 3", "nearest valid: 6 or 9"]),
    ({"data.seq_len": "2048"}, 1, "data.seq_len", "data.seq_len=2048",
     ["must not exceed model.max_seq_len = 1024"]),
    ({"model.vocab_size": "100"}, 1, "model.vocab_size", "model.vocab_size=100",
     ["must be >= the byte tokenizer's vocabulary (257)"]),
    # Parallel layout.
    ({"parallel.dp_replicate": "3"}, 2, "parallel", "'dp_replicate': 3",
     ["product of the degrees (3) must equal the world size (2 processes)"]),
    ({"parallel.tp": "2"}, 3, "parallel", "'dp_replicate': -1",
     ["world size 3 is not divisible by pp*dp_shard*ep*cp*tp = 2"]),
    ({"parallel.tp": "0"}, 1, "parallel.tp", "parallel.tp=0", ["must be >= 1"]),
    ({"parallel.dp_replicate": "-2"}, 1, "parallel.dp_replicate", "parallel.dp_replicate=-2",
     ["must be >= 1 (or -1 to fill the world)"]),
    ({"parallel.tp": "3"}, 3, "model.n_heads", "model.n_heads=8",
     ["must be divisible by parallel.tp = 3", "nearest valid: 6 or 9"]),
    ({"parallel.tp": "8"}, 8, "model.n_kv_heads", "model.n_kv_heads=4",
     ["must be divisible by parallel.tp = 8"]),
    ({"parallel.tp": "2", "parallel.sequence_parallel": "true", "data.seq_len": "255"}, 2,
     "data.seq_len", "data.seq_len=255", ["sequence parallelism"]),
    ({"parallel.cp": "2", "data.seq_len": "30"}, 2, "data.seq_len", "data.seq_len=30",
     ["2 * cp for zig-zag ring", "nearest: 32"]),
    ({"parallel.cp": "8", "parallel.cp_mode": "ulysses"}, 8, "parallel.cp", "parallel.cp=8",
     ["n_kv_heads=4 must be divisible by the Ulysses degree 8"]),
    ({"parallel.cp": "4", "parallel.cp_mode": "hybrid", "parallel.cp_ulysses": "3"}, 4,
     "parallel.cp_ulysses", "parallel.cp_ulysses=3", ["must divide parallel.cp = 4"]),
    ({"parallel.cp_mode": "zigzag"}, 1, "parallel.cp_mode", "parallel.cp_mode='zigzag'",
     ["must be one of ring, ulysses, hybrid, allgather"]),
    ({"parallel.dp_shard": "2", "parallel.pp": "2", "parallel.schedule": "zbv",
      "train.global_batch_size": "8"}, 4, "parallel.reshard_after_forward",
     "parallel.reshard_after_forward=True", ["splits the backward into I and W",
                                             "reshard_after_forward = false"]),
    ({"parallel.pp": "8"}, 8, "parallel.pp", "parallel.pp=8",
     ["must not exceed model.n_layers = 4"]),
    # Batch.
    ({}, 3, "train.global_batch_size", "train.global_batch_size=16",
     ["must be divisible by the data-parallel degree", "= 3", "nearest valid: 15 or 18"]),
    ({"train.micro_batch_size": "3"}, 2, "train.micro_batch_size", "train.micro_batch_size=3",
     ["must divide the per-rank batch", "16 / 2 = 8"]),
    # Hostile sizes: refused at once rather than walked by the memory estimators.
    ({"train.global_batch_size": "1000000000000", "train.micro_batch_size": "1"}, 1,
     "train.global_batch_size", "train.global_batch_size=1000000000000",
     ["gives 1,000,000,000,000 microbatches per rank and step", "at most 1,000,000"]),
    ({"model.n_layers": "100000000"}, 1, "model.n_layers", "model.n_layers=100000000",
     ["must be <= 100,000"]),
]


@pytest.mark.parametrize("overrides, world_size, field_name, field_and_value, rule_words",
                         REJECTED, ids=[f"{i:02d}-{case[2]}" for i, case in enumerate(REJECTED)])
def test_malformed_config_is_refused_naming_field_value_and_rule(
        overrides, world_size, field_name, field_and_value, rule_words) -> None:
    err = config_error(overrides, world_size)
    message = str(err)
    assert message.startswith("config error: ")
    assert err.field_name == field_name
    assert field_and_value in message
    for words in rule_words:
        assert words in message, f"{words!r} not in {message!r}"


def test_config_error_is_a_value_error_with_its_parts() -> None:
    err = config_error({"train.steps": "0"})
    assert isinstance(err, ValueError)
    assert (err.field_name, err.value, err.rule) == ("train.steps", 0, "must be >= 1")
    assert str(err) == "config error: train.steps=0: must be >= 1"


# --------------------------------------------------------------------------------------------
# Rejections from the config file


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    err = config_error(path=missing)
    assert err.field_name == "--config"
    assert str(missing) in str(err) and "file does not exist" in str(err)


def test_bad_toml_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[train]\nsteps = = 5\n")
    err = config_error(path=path)
    assert err.field_name == "--config"
    assert str(path) in str(err) and "is not valid TOML" in str(err)


@pytest.mark.parametrize("text, field_name, words", [
    ("[train]\nsetps = 5\n", "train.setps", ["unknown key", "did you mean 'train.steps'"]),
    ("[trian]\nsteps = 5\n", "trian.steps", ["unknown section", "did you mean 'train'"]),
    ("steps = 5\n", "steps", ["top-level keys must be sections like [train]"]),
    ("[train]\nsteps = 5.0\n", "train.steps", ["must be an integer"]),
    ("[train]\nsteps = true\n", "train.steps", ["must be an integer"]),
    ("[train]\nrun_dir = 7\n", "train.run_dir", ["must be a string"]),
    ("[metrics]\nplot = 1.5\n", "metrics.plot", ["must be a boolean"]),
    ("[data]\nextensions = 5\n", "data.extensions", ["must be a list"]),
])
def test_malformed_toml_values(tmp_path: Path, text: str, field_name: str,
                               words: list[str]) -> None:
    err = config_error(path=write_toml(tmp_path, text))
    assert err.field_name == field_name
    for w in words:
        assert w in str(err)


def test_command_line_override_beats_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[train]\nsteps = 7\nseed = 3\n")
    config = load_config(path, {"train.steps": "9"})
    assert (config.train.steps, config.train.seed) == (9, 3)


# --------------------------------------------------------------------------------------------
# Found while writing these specifications: rules the validator does not yet enforce.


def test_too_small_bpe_vocabulary_is_a_config_error() -> None:
    err = config_error({"data.tokenizer": "bpe", "data.bpe_vocab_size": "100"})
    assert err.field_name == "data.bpe_vocab_size"


@pytest.mark.parametrize("key, raw", [("optim.lr", "nan"), ("train.grad_clip", "inf")])
def test_non_finite_numbers_are_refused(key: str, raw: str) -> None:
    err = config_error({key: raw})
    assert err.field_name == key and "finite" in str(err)


@pytest.mark.parametrize("key, raw", [("train.timeout_s", "0"), ("optim.eps", "-1e-8")])
def test_unchecked_numeric_fields_are_refused(key: str, raw: str) -> None:
    assert config_error({key: raw}).field_name == key


# --------------------------------------------------------------------------------------------
# What resolves


@pytest.mark.parametrize("world_size", [1, 2])
def test_defaults_resolve_and_dp_replicate_fills_the_world(world_size: int) -> None:
    config = resolve(load_config(), world_size)
    assert config.parallel.dp_replicate == world_size
    assert config.parallel.dp == world_size
    assert config.parallel.degrees() == {"pp": 1, "dp_replicate": world_size, "dp_shard": 1,
                                         "ep": 1, "cp": 1, "tp": 1}


def test_defaults_resolve_at_world_size_4() -> None:
    assert resolve(load_config(), 4).parallel.dp_replicate == 4


def test_world_size_4_resolves_with_a_micro_batch_that_fits() -> None:
    config = resolve(load_config(None, {"train.micro_batch_size": "4"}), 4)
    assert config.parallel.dp_replicate == 4


def test_explicit_degrees_matching_the_world_resolve_unchanged() -> None:
    config = resolve(load_config(None, {"parallel.dp_replicate": "2"}), 2)
    assert config.parallel.dp_replicate == 2


def test_resolve_does_not_modify_its_input() -> None:
    config = load_config()
    resolve(config, 2)
    assert (config.parallel.dp_replicate, config.model.vocab_size) == (-1, 0)


@pytest.mark.parametrize("multiple, expected", [(64, 320), (1, 257), (8, 264), (128, 384)])
def test_vocab_size_0_is_the_tokenizer_vocab_rounded_up(multiple: int, expected: int) -> None:
    # The byte tokenizer has 256 byte values + 1 end-of-document token = 257 ids.
    config = resolve(load_config(None, {"model.vocab_multiple": str(multiple)}), 1)
    assert config.model.vocab_size == expected


def test_bpe_vocab_size_is_rounded_up_too() -> None:
    overrides = {"data.tokenizer": "bpe", "data.bpe_vocab_size": "1000"}
    assert resolve(load_config(None, overrides), 1).model.vocab_size == 1024


def test_explicit_vocab_size_is_kept() -> None:
    assert resolve(load_config(None, {"model.vocab_size": "300"}), 1).model.vocab_size == 300


def test_preset_applies_its_shape() -> None:
    config = load_config(None, {"model.preset": "debug"})
    debug = PRESETS["debug"]
    assert (config.model.dim, config.model.n_layers, config.model.n_heads,
            config.model.n_kv_heads, config.model.ffn_dim, config.model.max_seq_len) == (
        debug.dim, debug.n_layers, debug.n_heads, debug.n_kv_heads, debug.ffn_dim,
        debug.max_seq_len)
    assert config.model.vocab_size == 0  # small presets size the vocabulary from the tokenizer


def test_large_preset_keeps_its_published_vocabulary() -> None:
    config = load_config(None, {"model.preset": "llama3-8b"})
    assert (config.model.dim, config.model.vocab_size) == (4096, 128256)


def test_explicit_override_beats_the_preset_in_either_order(tmp_path: Path) -> None:
    config = load_config(None, {"model.n_layers": "2", "model.preset": "debug"})
    assert (config.model.preset, config.model.n_layers, config.model.dim) == ("debug", 2, 64)
    path = write_toml(tmp_path, '[model]\ndim = 128\npreset = "debug"\n')
    config = load_config(path, {"model.n_heads": "8"})
    assert (config.model.dim, config.model.n_heads, config.model.n_layers) == (128, 8, 4)


def test_toml_round_trip_gives_an_equal_config(tmp_path: Path) -> None:
    original = resolve(load_config(None, {
        "model.preset": "debug", "train.steps": "17", "optim.lr": "1e-4", "optim.eps": "1e-10",
        "data.extensions": ".py,.rst", "metrics.plot": "false", "train.run_dir": 'a "quoted"\\dir',
        "train.dtype": "bf16", "parallel.dp_replicate": "2"}), 2)
    path = write_toml(tmp_path, to_toml(original))
    assert load_config(path) == original
    assert from_dict(to_dict(original)) == original


def test_default_config_round_trips_unresolved(tmp_path: Path) -> None:
    assert load_config(write_toml(tmp_path, to_toml(Config()))) == Config()


def test_to_dict_is_plain_data() -> None:
    table = to_dict(load_config())
    assert set(table) == {f.name for f in dataclasses.fields(Config)}
    assert table["data"]["extensions"] == [".py", ".txt", ".md"]  # a list, as TOML has it


# --------------------------------------------------------------------------------------------
# Overrides


def test_parse_overrides_equals_and_space_forms() -> None:
    argv = ["--train.steps=5", "--model.dim", "64", "--train.run_dir=a=b", "--optim.lr", "-1"]
    assert parse_overrides(argv) == {"train.steps": "5", "model.dim": "64",
                                     "train.run_dir": "a=b", "optim.lr": "-1"}
    assert parse_overrides([]) == {}


def test_later_override_of_the_same_key_wins() -> None:
    assert parse_overrides(["--train.steps=5", "--train.steps=6"]) == {"train.steps": "6"}


@pytest.mark.parametrize("argv, words", [
    (["train.steps=5"], "expected --section.key=value"),
    (["--steps=5"], "expected --section.key=value"),
    (["--train.steps"], "has no value"),
])
def test_malformed_overrides(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match="config error: .*" + words):
        parse_overrides(argv)


def test_space_form_does_not_swallow_the_next_option() -> None:
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.run_dir", "--train.steps=5"])


def test_overrides_are_typed() -> None:
    config = load_config(None, parse_overrides([
        "--train.steps=5", "--optim.lr", "1e-3", "--metrics.plot=off", "--metrics.jsonl=TRUE",
        "--train.dtype=bf16"]))
    assert config.train.steps == 5 and isinstance(config.train.steps, int)
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)
    assert config.metrics.plot is False and config.metrics.jsonl is True
    assert config.train.dtype == "bf16"


def test_tuple_field_from_comma_string_and_toml_array(tmp_path: Path) -> None:
    assert load_config(None, {"data.extensions": ".py, .md,,"}).data.extensions == (".py", ".md")
    path = write_toml(tmp_path, '[data]\nextensions = [".txt", ".rst"]\n')
    assert load_config(path).data.extensions == (".txt", ".rst")


def test_existing_data_source_path_is_accepted(tmp_path: Path) -> None:
    # trains on "hell" (validation gets "o") + end-of-document: one sample of seq_len 4
    (tmp_path / "corpus.txt").write_text("hello")
    config = resolve(load_config(None, {"data.source": str(tmp_path / "corpus.txt"),
                                        "data.seq_len": "4"}), 1)
    assert config.data.source == str(tmp_path / "corpus.txt")
