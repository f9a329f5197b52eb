"""Hypothesis strategies of the fuzz suite, drawn from Loom's real config fields.

``FIELDS`` introspects the config dataclasses (``loom.config``): every ``section.key`` with its
type. Values come from the type (valid, boundary, out of range, negative, huge, NaN/inf, empty,
unicode, wrong type), from per-field lists of meaningful and near-miss strings (presets, schedule
families, devices, paths of the workspace made by ``harness.populate``), and from joint draws of
the fields that constrain each other (parallel degrees, world size, batch sizes, schedules).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import typing
from typing import Any, Literal

from hypothesis import strategies as st

from loom import config as loom_config

# ---------------------------------------------------------------------------------------------
# The fields


def _fields() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in dataclasses.fields(loom_config.Config):
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f"{section.name}.{f.name}"] = hints[f.name]
    return out


FIELDS: dict[str, Any] = _fields()
KEYS = sorted(FIELDS)


def _presets() -> list[str]:
    from loom.models.presets import PRESETS

    return list(PRESETS)


def _schedules() -> list[str]:
    try:
        from loom.schedule.families import simulation_only, trainable
        from loom.schedule.select import SEARCH
    except ImportError:  # before the schedule package moved out of loom.pipeline
        from loom.pipeline.schedules import SEARCH, simulation_only, trainable

    return [*trainable(), *simulation_only(), SEARCH]


SMALL_PRESETS = ["debug", "tiny", "tiny-moe"]
INT_EDGES = [0, 1, -1, 2, 3, 4, 5, 7, 8, 16, 64, 255, 256, 257, 320, 1024, 65535, 65536,
             2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 10**30]
BAD_INTS = ["", " ", "1.5", "abc", "1e3", "0x10", "0b11", "１２", "٣", " 4", "4 ", "+4", "-0",
            "1_0", "_1", "9" * 5000, "nan", "inf", "true", "None", "[]", "4\n", "4\x00"]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, 5e-324, 1e308, -1e308, 0.999999999,
               1.0000000001, 1e-8, 2.0, 100.0]
BAD_FLOATS = ["", "abc", "1,5", "1e400", "-1e400", "0x1p3", "nan", "NaN", "-nan", "inf", "-inf",
              "Infinity", "1_0.5", "١.٥", "1e", ".", "--1", "1.0.0", "true"]
BOOLS = ["true", "false", "True", "FALSE", "1", "0", "yes", "no", "on", "off", "", "2", "maybe",
         "tru", " true", "t", "ＴＲＵＥ"]
TEXT = st.text(st.characters(codec="utf-8"), max_size=24)
ODD_TEXT = st.sampled_from(["", " ", "\x00", "a\x00b", "é", "日本語", "🙂", "\u202e", "\r\n",
                            "'", '"', "\\", "${HOME}", "~", "..", "/", "-", "--", "=", "x" * 300,
                            "-1", "NaN", "None", "null"])

# Per-field meaningful values and near misses. Paths are relative to a workspace made by
# ``harness.populate`` (the tests run with it as the working directory).
SPECIAL: dict[str, list[str]] = {
    "model.preset": _presets() + ["Tiny", "tiny ", "", "llama3", "tiny_moe", "debug\x00"],
    "parallel.schedule": _schedules() + ["SEARCH", "1F1B", "zb-h1", "Interleaved-1F1B", "nope",
                                         "", "1f1b "],
    "parallel.schedule_costs": ["1,1,1,0", "1,1,1", "1,2,3,4,5", "a,b,c,d", "", ",,,",
                                "1,1,1,0;1,1,1,0", "1,1,1;1,1,1;0", "-1,1,1,0", "nan,1,1,0",
                                "1e400,1,1,0", "0,0,0,0", "inf,1,1,0", "1;2;3;4", ";"],
    "parallel.schedule_placement": ["auto", "looped", "interleaved", "v", "V", "", "zigzag"],
    "parallel.cp_mode": ["ring", "ulysses", "hybrid", "Ring", "", "tree"],
    "train.device": ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:x", "cuda:-1", "cuda:",
                     "mps", "xpu", "tpu", "", "CPU", "cpu:0", "meta"],
    "train.backend": ["auto", "gloo", "nccl", "mpi", "", "GLOO"],
    "train.dtype": ["fp32", "bf16", "fp16", "FP32", ""],
    "train.grad_reduce_dtype": ["fp32", "bf16", "fp16"],
    "train.nonfinite": ["stop", "skip", "raise", ""],
    "train.recompute": ["none", "full", "selective", "every_k", "all", ""],
    "data.tokenizer": ["byte", "bpe", "BPE", "char", ""],
    "data.source": ["stdlib", "", "corpus.txt", "corpus", "corpus/", "./corpus.txt",
                    "missing.txt", "/nonexistent/corpus", "fifo", "empty.txt", "binary.bin",
                    "ckpt", "corpus.txt/x", "~/corpus.txt", "a\x00b"],
    "data.extensions": [".py", ".txt,.md", ".py,.txt", "", ",", "py", ".TXT", "*", ".bin",
                        " .txt , .py ", ".txt,,", "é"],
    "checkpoint.resume": ["", "auto", "auto_or_fresh", "ckpt", "ckpt/", "ckpt_nomanifest",
                          "ckpt_deep", "ckpt_fifo", "missing", "corpus.txt", "AUTO", "fifo",
                          "a\x00b"],
    "train.run_dir": ["", "run", "runs/x", "a/b/c", "ünï", "run dir", "corpus.txt/run",
                      "x" * 300, "r\x00n", "corpus", "empty.txt"],
}


# ---------------------------------------------------------------------------------------------
# Values as command-line strings (what `--section.key=value` carries)


def _int_text() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(INT_EDGES).map(str), st.integers(-3, 70).map(str),
                     st.integers().map(str), st.sampled_from(BAD_INTS),
                     st.floats().map(repr), TEXT)


def _float_text() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(FLOAT_EDGES).map(repr), st.floats().map(repr),
                     st.floats(0, 1).map(repr), st.integers(-5, 1000).map(str),
                     st.sampled_from(BAD_FLOATS), TEXT)


def text_value(key: str) -> st.SearchStrategy[str]:
    """Strings for ``--key=VALUE``: valid, near miss, out of range or of the wrong type."""
    kind = FIELDS.get(key, str)
    options = []
    if key in SPECIAL:
        options.append(st.sampled_from(SPECIAL[key]))
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = [str(c) for c in typing.get_args(kind)]
        options.append(st.sampled_from(choices + [c.upper() for c in choices] + [""]))
    elif kind is bool:
        options.append(st.sampled_from(BOOLS))
    elif kind is int:
        options.append(_int_text())
    elif kind is float:
        options.append(_float_text())
    elif origin is tuple or kind is tuple:
        options.append(st.lists(st.sampled_from([".py", ".txt", ".md", "", " ", ".x", "é"]),
                                max_size=4).map(",".join))
    options.append(st.one_of(TEXT, ODD_TEXT))  # any field, any string
    return st.one_of(*options)


def unknown_key() -> st.SearchStrategy[str]:
    """Keys that do not exist: typos of real ones, unknown sections, odd characters."""
    typo = st.sampled_from(KEYS).flatmap(lambda k: st.sampled_from(
        [k + "s", k[:-1], k.replace(".", ".."), k.upper(), k.replace("_", "-"),
         k.split(".")[0] + ".", "." + k.split(".")[1], k + ".x"]))
    odd = st.builds(lambda a, b: f"{a}.{b}", st.sampled_from(
        ["train", "model", "nosuch", "", "Train", "data ", "é"]), TEXT)
    return st.one_of(typo, odd)


@st.composite
def layout(draw: st.DrawFn, *, small: bool = False) -> tuple[dict[str, str], int]:
    """Joint draw of the fields that constrain each other, mostly consistent, sometimes off by
    one: parallel degrees and world size, batch sizes and microbatches, schedule and chunks,
    heads / layers / experts / sequence length against the degrees that split them."""
    factors = [1, 1, 1, 2, 2, 3, 4] if not small else [1, 1, 1, 2]
    deg = {axis: draw(st.sampled_from(factors)) for axis in ("pp", "dp_shard", "ep", "cp", "tp")}
    dp_rep = draw(st.sampled_from([-1, -1, 1, 2, 3]))
    world = math.prod(deg.values()) * (1 if dp_rep == -1 else dp_rep)
    if world > 16:
        deg = {k: 1 for k in deg}
        world = 1 if dp_rep == -1 else dp_rep
    world += draw(st.sampled_from([0, 0, 0, 0, 0, 1, -1]))
    world = max(world, draw(st.sampled_from([0, 1, 1])))
    dp = (1 if dp_rep == -1 else dp_rep) * deg["dp_shard"] * deg["ep"]
    if dp_rep == -1 and world % max(1, math.prod(deg.values())) == 0 and world > 0:
        dp = world // math.prod(deg.values()) * deg["dp_shard"] * deg["ep"]
    micro = draw(st.sampled_from([1, 1, 2, 4]))
    m = draw(st.sampled_from([1, 2, 2, 3, 4, 8]))
    gbs = max(1, dp) * micro * m + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    out = {f"parallel.{k}": str(v) for k, v in deg.items()}
    out["parallel.dp_replicate"] = str(dp_rep)
    out["train.global_batch_size"] = str(gbs)
    out["train.micro_batch_size"] = str(micro)
    preset = draw(st.sampled_from(SMALL_PRESETS + ([] if small else ["llama3-8b", "mixtral-8x7b"])))
    out["model.preset"] = preset
    if deg["pp"] > 1 or draw(st.booleans()):
        out["parallel.schedule"] = draw(st.sampled_from(_schedules() + ["1f1b"] * 3))
        out["parallel.chunks"] = str(draw(st.sampled_from([0, 0, 1, 2, 3])))
    if draw(st.booleans()):
        out["model.n_layers"] = str(draw(st.sampled_from([1, 2, 4, 6, 8])))
    if draw(st.booleans()):
        out["data.seq_len"] = str(draw(st.sampled_from([8, 16, 24, 32, 48, 64])))
    else:
        out["data.seq_len"] = "32"
    if deg["ep"] > 1 or draw(st.booleans()):
        out["model.n_experts"] = str(draw(st.sampled_from([0, 2, 4, 6, 8])))
    if deg["dp_shard"] > 1:
        out["parallel.zero_stage"] = str(draw(st.sampled_from([1, 2, 3])))
        if draw(st.booleans()):
            out["parallel.reshard_after_forward"] = draw(st.sampled_from(["true", "false"]))
    if deg["cp"] > 1:
        out["parallel.cp_mode"] = draw(st.sampled_from(["ring", "ulysses", "hybrid"]))
    if deg["tp"] > 1 and draw(st.booleans()):
        out["parallel.sequence_parallel"] = "true"
    if draw(st.booleans()):
        out["train.post_validation"] = draw(st.sampled_from(["true", "false"]))
    return out, world


@st.composite
def overrides(draw: st.DrawFn, *, small: bool = False, exclude: tuple[str, ...] = ()
              ) -> tuple[dict[str, str], int]:
    """A layout, then 0-5 random fields (sometimes unknown keys) with random values."""
    base, world = draw(layout(small=small))
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 9)) == 0:
            key = draw(unknown_key())
        else:
            # fields with meaningful values of their own (paths, names) drawn 3x as often
            key = draw(st.sampled_from([k for k in KEYS + [*SPECIAL] * 2 if k not in exclude]))
        base[key] = draw(text_value(key))
    return base, world


# ---------------------------------------------------------------------------------------------
# Values as TOML would produce them (typed), for load_config directly

TOML_SCALARS = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(), TEXT,
    st.datetimes(timezones=st.none() | st.just(datetime.timezone.utc)), st.dates(), st.times())
TOML_VALUES = st.recursive(
    TOML_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6)


@st.composite
def typed_overrides(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """Overrides whose values have any TOML type (lists, tables, dates ...), as a TOML file's
    keys reach ``load_config``."""
    base, world = draw(layout())
    out: dict[str, Any] = dict(base)
    for _ in range(draw(st.integers(1, 4))):
        # the preset is read before any other key (and compared against the preset table)
        # an unknown key is refused before any value is looked at: 1 in 10
        key = draw(unknown_key() if draw(st.integers(0, 9)) == 0
                   else st.sampled_from(KEYS + ["model.preset"] * 8))
        out[key] = draw(st.one_of(TOML_SCALARS, st.lists(TOML_SCALARS, max_size=3),
                                  st.dictionaries(TEXT, TOML_SCALARS, max_size=2),
                                  TOML_VALUES, text_value(key)))
    return out, world
