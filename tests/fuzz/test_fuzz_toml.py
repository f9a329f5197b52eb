"""Fuzzing ``loom train --config FILE``: the file's bytes are random (arbitrary bytes, random
UTF-8 text, random TOML documents over Loom's sections and keys with values of every TOML type)
or a valid config (``configs/*.toml``, a resolved ``to_toml`` dump) with its bytes mutated.

Property: exit 2 with one line and nothing written, or exit 0 having changed nothing outside the
run directory (workers replaced by a stub); never a traceback. ``load_config(FILE)`` alone
returns a Config or raises ``ConfigError``.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import harness, strategies as S
from tests.fuzz.harness import check, fuzz_settings, workspace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _valid_files() -> list[bytes]:
    def make():
        from loom.config import load_config, resolve, to_toml

        files = [p.read_bytes() for p in sorted((ROOT / "configs").glob("*.toml"))]
        small = {"model.preset": "debug", "data.max_bytes": "50000", "data.seq_len": "32",
                 "train.run_dir": "run", "train.global_batch_size": "4",
                 "train.micro_batch_size": "2"}
        files.append(to_toml(resolve(load_config(None, small), 1)).encode())
        return files
    return harness.once("valid-toml", make)


# ---------------------------------------------------------------------------------------------
# Writing TOML (tomllib only reads)

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key, ensure_ascii=False)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return json.dumps(str(value), ensure_ascii=False)


def _native(key: str, text: str):
    """A command-line string as the TOML value a user would write for that field."""
    kind = S.FIELDS.get(key)
    try:
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is bool:
            return {"true": True, "false": False}[text]
    except (ValueError, KeyError):
        pass
    return text


@st.composite
def toml_documents(draw) -> str:
    """A TOML document over Loom's sections and keys (and unknown ones), values of any type."""
    sections = sorted({k.split(".")[0] for k in S.KEYS})
    lines = []
    if draw(st.integers(0, 9)) == 0:  # top-level keys are not allowed
        lines.append(f"{toml_key(draw(S.TEXT))} = {toml_value(draw(S.TOML_VALUES))}")
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.sampled_from(sections) | S.TEXT)
        header = draw(st.sampled_from(["[{}]", "[{}]", "[{}]", "[[{}]]", "[{}.sub]"]))
        lines.append(header.format(toml_key(section)))
        keys = [k.split(".", 1)[1] for k in S.KEYS if k.startswith(section + ".")]
        for _ in range(draw(st.integers(0, 5))):
            name = draw(st.sampled_from(keys) if keys and draw(st.integers(0, 4)) else S.TEXT)
            key = f"{section}.{name}"
            value = draw(st.one_of(S.text_value(key).map(lambda t, k=key: _native(k, t)),
                                   S.TOML_VALUES))
            lines.append(f"{toml_key(name)} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


@st.composite
def mutated_valid(draw) -> bytes:
    """A valid config file with 1-4 byte-level mutations."""
    data = bytearray(draw(st.sampled_from(_valid_files())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate", "dup-line",
                                   "swap-lines", "replace-token", "header"]))
        n = len(data)
        if op == "flip" and n:
            i = draw(st.integers(0, n - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "delete" and n:
            i = draw(st.integers(0, n - 1))
            del data[i: i + draw(st.integers(1, 16))]
        elif op == "insert":
            i = draw(st.integers(0, n))
            data[i:i] = draw(st.binary(min_size=1, max_size=12) | st.sampled_from(
                [b"=", b"[", b"]", b'"', b"\n", b"\x00", b"\xff", b"\r", b"#", b"nan", b"-1",
                 b"\xc3", b"[train]\n", b"'''", b'"""', b"\\u0000"]))
        elif op == "truncate":
            del data[draw(st.integers(0, n)):]
        else:
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            if op == "dup-line":
                lines.insert(i, lines[i])
            elif op == "swap-lines":
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            elif op == "replace-token" and b"=" in lines[i]:
                key = lines[i].split(b"=", 1)[0]
                name = key.strip().decode("utf-8", "replace")
                section = next((ln.strip(b"[] ").decode("utf-8", "replace")
                                for ln in reversed(lines[:i]) if ln.startswith(b"[")), "train")
                value = draw(S.text_value(f"{section}.{name}").map(
                    lambda t, k=f"{section}.{name}": _native(k, t)) | S.TOML_VALUES)
                lines[i] = key + b"= " + toml_value(value).encode("utf-8", "surrogatepass")
            elif op == "header":
                lines.insert(i, draw(st.sampled_from([b"[train]", b"[model]", b"[nosuch]",
                                                      b"[[data]]", b"[train.x]", b"["])))
            data = bytearray(b"\n".join(lines))
    return bytes(data)


def _extra_args(raw: bytes) -> list[str]:
    """Overrides that keep an accepted file cheap and inside the workspace, and that change no
    refusal: a small prefix of the stdlib corpus, a run directory in the workspace."""
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return []
    extra = []
    data = table.get("data") if isinstance(table.get("data"), dict) else {}
    train = table.get("train") if isinstance(table.get("train"), dict) else {}
    max_bytes = data.get("max_bytes", 0)
    if data.get("source", "stdlib") == "stdlib" and isinstance(max_bytes, int) \
            and not isinstance(max_bytes, bool) and (max_bytes == 0 or max_bytes > 200_000):
        extra.append("--data.max_bytes=100000")
    for key, value in (("data.source", data.get("source")),
                       ("checkpoint.resume", (table.get("checkpoint") or {}).get("resume")
                        if isinstance(table.get("checkpoint"), dict) else None),
                       ("train.run_dir", train.get("run_dir"))):
        if isinstance(value, str):
            safe = harness.contain_paths({key: value})[key]
            if safe != value:
                extra.append(f"--{key}={safe}")
    return extra


def _run(raw: bytes, category: str) -> None:
    with workspace() as root:
        harness.populate(root)
        (root / "config.toml").write_bytes(raw)
        argv = ["--config", "config.toml", *_extra_args(raw)]
        outcome = harness.run_cli(argv, root)
        if outcome.kind != "other":  # the library call agrees: a Config or ConfigError
            with harness.chdir(root):
                direct = harness.config_fast({}, 1, path="config.toml")
            if direct.kind == "other":
                outcome = direct
        check(category, outcome, raw)


@fuzz_settings("toml_bytes")
@given(st.one_of(st.binary(max_size=600),
                 st.text(st.characters(codec="utf-8"), max_size=300).map(str.encode),
                 toml_documents().map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_random_config_files_exit_0_or_2(raw):
    _run(raw, "toml-random")


@fuzz_settings("toml_mutated")
@given(mutated_valid())
def test_mutated_config_files_exit_0_or_2(raw):
    _run(raw, "toml-mutated")
