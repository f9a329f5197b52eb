"""Input files the user names are read by ``loom.errors.read_input_text``: a device, a FIFO, a
directory or a huge file is refused by name at once (never opened or never read to the end), and
every reader (config, cluster, costs, schedule CSV, hardware catalog, length distribution) turns
the refusal into its own one-line error naming its flag."""

from __future__ import annotations

import os

import pytest

from loom.cluster import load as load_cluster
from loom.config import ConfigError, load_config
from loom.errors import MAX_INPUT_BYTES, InputFileError, read_input_text
from loom.plan.hardware import HardwareError, load_catalog
from loom.schedule.cost import StageCosts
from loom.schedule.ir import Schedule
from loom.sim.varlen_cost import load_length_distribution


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.csv"
    os.mkfifo(path)  # opening it for reading would block until a writer comes: never opened
    return path


def test_plain_text_is_read(tmp_path):
    (tmp_path / "a.toml").write_text("x = 'é'\n", encoding="utf-8")
    assert read_input_text(tmp_path / "a.toml") == "x = 'é'\n"


@pytest.mark.parametrize("make, rule", [
    (lambda tmp: tmp / "missing.toml", "file does not exist"),
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: "/dev/zero", "is not a regular file"),
])
def test_what_is_not_a_readable_file_is_named(tmp_path, make, rule):
    with pytest.raises(InputFileError, match=rule) as err:
        read_input_text(make(tmp_path))
    assert str(err.value).startswith(f"{make(tmp_path)}: ")


def test_a_fifo_is_refused_without_blocking(fifo):
    with pytest.raises(InputFileError, match="is not a regular file"):
        read_input_text(fifo)


def test_a_file_over_the_limit_is_refused_unread(tmp_path):
    big = tmp_path / "big.csv"
    with open(big, "wb") as handle:  # sparse: no disk used
        handle.truncate(MAX_INPUT_BYTES + 1)
    with pytest.raises(InputFileError, match="is larger than 64 MiB"):
        read_input_text(big)


def test_bytes_that_are_not_utf8_are_named(tmp_path):
    (tmp_path / "latin1.toml").write_bytes(b"name = '\xe9'\n")
    with pytest.raises(InputFileError, match=r"is not UTF-8 text \(byte 8"):
        read_input_text(tmp_path / "latin1.toml")


@pytest.mark.parametrize("read, error, named", [
    (lambda path: load_config(path), ConfigError, "--config"),
    (load_cluster, ConfigError, "cluster"),
    (load_length_distribution, ConfigError, "--length-dist"),
    (load_catalog, HardwareError, "--hardware"),
    (StageCosts.from_file, InputFileError, ""),
    (Schedule.from_torch_csv, InputFileError, ""),
])
def test_every_reader_refuses_a_fifo_by_its_name(fifo, read, error, named):
    with pytest.raises(error, match="is not a regular file") as err:
        read(str(fifo))
    assert named in str(err.value) and str(fifo) in str(err.value)


DEEP_TOML = "a = " + "[" * 50_000 + "]" * 50_000 + "\n"
DEEP_JSON = "[" * 50_000 + "]" * 50_000


@pytest.mark.parametrize("read, error, named, text, suffix", [
    (lambda path: load_config(path), ConfigError, "--config", DEEP_TOML, ".toml"),
    (load_cluster, ConfigError, "cluster", DEEP_TOML, ".toml"),
    (load_catalog, HardwareError, "--hardware", DEEP_TOML, ".toml"),
    (load_length_distribution, ConfigError, "--length-dist", DEEP_JSON, ".json"),
    (StageCosts.from_file, ValueError, "", DEEP_JSON, ".json"),
    (lambda path: Schedule.from_json(read_input_text(path)), ValueError, "", DEEP_JSON, ".json"),
])
def test_nesting_deeper_than_the_parser_is_a_decode_error_not_a_crash(
        tmp_path, read, error, named, text, suffix):
    """``[[[[...`` tens of thousands deep overflows the stdlib parsers' recursion: every reader
    refuses it like any malformed file (``loads_json`` / ``loads_toml``), not ``RecursionError``."""
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    with pytest.raises(error, match="nested too deeply") as err:
        read(str(path))
    assert named in str(err.value)
