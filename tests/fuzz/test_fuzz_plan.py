"""Fuzzing ``loom plan --layout``: random what-if layouts of every ``Layout`` field; and
``loom plan --mixed``: random cluster files of unlike parts.

``--layout`` prices one layout the planner did not choose, so its fields arrive unchecked by any
search space: degrees of 0 or below, unknown modes, schedules whose chunks do not fit their
family, batch sizes of 0, splits of a dense model over experts. Each either prices (exit 0) or
is refused on one line naming the field (exit 2); a traceback is a failure. Before
``loom.plan.layout_input`` 25 of 300 such layouts crashed the planner (seven causes: an unknown
schedule at pp > 1, division by a zero micro batch or chunk count, a fixed-chunk family given
other chunks, a bad cp mode, ...), and 666 of 1,296 searched or SkipPipe layouts (the search's
stages per rank against the layout's chunks, a limit below one unit, SkipPipe simulated as a
family); the regression cases below are those.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.harness import check, fuzz_settings

DEGREES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
VALUES = {
    "pp": [1, 2, 4, 3, 0, -1, 16], "dp_replicate": [1, 2, 4, 0, -2], "dp_shard": [1, 2, 4, 0],
    "ep": [1, 2, 4, 3, 0], "cp": [1, 2, 4, 3, 0], "tp": [1, 2, 4, 8, 3, 0, 64],
    "zero_stage": [0, 1, 2, 3, 4, -1], "reshard_after_forward": ["true", "false", "maybe"],
    "sequence_parallel": ["true", "false"], "vocab_parallel": ["true", "false"],
    "cp_mode": ["ring", "ulysses", "hybrid", "allgather", "Ring", "bogus"],
    "cp_ulysses": [0, 2, 3, -1], "chunks": [0, 1, 2, 3, 4, 8, -1],
    "schedule": ["none", "1f1b", "gpipe", "interleaved_1f1b", "zbv", "zb_h1", "zb_h2", "v_half",
                 "v_min", "dualpipev", "hanayo", "bidirectional_v", "bitpipe", "looped_bfs",
                 "search", "skippipe", "ZBV", "zb-h1", "nosuch", ""],
    "schedule_memory_limit": [0, 0.5, 2, -1, 1e9, "nan", "inf"],
    "schedule_costs": ["", "x"], "schedule_placement": ["auto", "looped", "v", "wave", "bogus"],
    "schedule_offload_limit": [0, 1, 2, -1], "micro_batch": [1, 2, 0, -1, 1000],
    "microbatches": [1, 2, 4, 8, 32, 0, -3, 3], "recompute_every": [0, 1, 2, -1],
    "recompute": ["none", "full", "selective", "every_k", "bogus"],
    "vocab_parallel_pp": ["true", "false"],
}
MODELS = ["llama3-8b", "tiny-moe", "mixtral-8x7b", "gpt3-175b", "debug"]


@st.composite
def plan_args(draw) -> list[str]:
    """A ``loom plan --layout`` command line; --gpus usually the layout's degrees' product."""
    fields = draw(st.lists(st.sampled_from(sorted(VALUES)), min_size=1, max_size=8, unique=True))
    layout = {name: draw(st.sampled_from(VALUES[name])) for name in fields}
    gpus = 1
    for axis in DEGREES:
        value = layout.get(axis, 1)
        gpus *= value if isinstance(value, int) and value > 0 else 1
    if draw(st.integers(0, 9)) == 0:
        gpus = draw(st.sampled_from([1, 3, 16]))
    text = ",".join(f"{name}={value}" for name, value in layout.items())
    return ["plan", "--model", draw(st.sampled_from(MODELS)), "--gpus", str(gpus),
            "--gpu", draw(st.sampled_from(["H100-SXM", "A100-80GB"])),
            "--seq", str(draw(st.sampled_from([2048, 4096, 1000]))),
            "--global-batch-tokens", str(draw(st.sampled_from([1048576, 4096]))),
            "--layout", text]


def plan_outcome(args: list[str]) -> harness.Outcome:
    """``loom.cli.main(args)`` in-process: ok (exit 0), refused (exit 2 with exactly one line on
    stderr) or other (any exception, another exit code, or a refusal of several lines)."""
    from loom.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    except Exception as caught:  # noqa: BLE001 - the property: nothing but exit 0 or 2
        return harness.from_exception(caught, "loom plan: ")
    lines = err.getvalue().strip().splitlines()
    if code == 0:
        return harness.Outcome("ok")
    if code == 2 and len(lines) == 1:
        return harness.Outcome("refused", lines[0])
    return harness.Outcome("other", f"exit {code}, {len(lines)} line(s): {err.getvalue()[-400:]}")


@fuzz_settings("plan_layout")
@given(plan_args())
def test_a_what_if_layout_prices_or_is_refused_on_one_line(args):
    check("plan-layout", plan_outcome(args), args)


COMMON = ["plan", "--gpu", "H100-SXM", "--seq", "2048", "--global-batch-tokens", "1048576"]


@pytest.mark.parametrize("model, gpus, layout, field", [
    ("mixtral-8x7b", 4, "ep=2,pp=2", "schedule=none"),  # pp > 1 with no schedule
    ("llama3-8b", 256, "micro_batch=0,dp_shard=4,tp=64,zero_stage=3", "micro_batch=0"),
    ("llama3-8b", 16, "cp=4,microbatches=-3,chunks=8", "microbatches=-3"),
    ("mixtral-8x7b", 3, "cp=3,pp=1,chunks=-1", "chunks=-1"),
    ("tiny-moe", 1, "chunks=0,ep=1", "chunks=0"),  # no pipeline: one stage per rank
    ("tiny-moe", 4, "tp=4,cp=1,cp_mode=bogus", "cp_mode=bogus"),
    ("mixtral-8x7b", 32, "schedule=hanayo,pp=16,dp_replicate=2", "schedule=hanayo"),  # chunks
    ("tiny-moe", 16, "chunks=4,schedule=v_min,pp=16", "chunks=4"),
    ("llama3-8b", 16, "pp=4,dp_replicate=4,schedule=zbv,chunks=3,microbatches=32", "chunks=3"),
    ("llama3-8b", 16, "pp=4,dp_replicate=4,schedule=nosuch,microbatches=32", "schedule=nosuch"),
    ("llama3-8b", 4, "ep=2,dp_replicate=2", "ep=2"),  # a dense model has no experts
    # the schedule search: priced looped (chunks 1) or V (chunks 2), a limit of >= 1 unit
    ("llama3-8b", 2, "pp=2,schedule=search,chunks=0,microbatches=4", "chunks=0"),
    ("llama3-8b", 2, "pp=2,schedule=search,chunks=1,schedule_placement=v,microbatches=4",
     "schedule_placement=v"),
    ("llama3-8b", 2, "pp=2,schedule=search,schedule_memory_limit=0.5,microbatches=4",
     "schedule_memory_limit=0.5"),
    ("llama3-8b", 16, "pp=16,schedule=skippipe,chunks=4,microbatches=16", "chunks=4"),
])
def test_the_layouts_that_crashed_the_planner_are_refused_by_field(model, gpus, layout, field):
    outcome = plan_outcome([*COMMON, "--model", model, "--gpus", str(gpus), "--layout", layout])
    assert outcome.kind == "refused", outcome
    assert f"--layout {field}" in outcome.detail, outcome.detail


def test_a_skippipe_layout_is_priced_as_gpipe():
    """It crashed the simulation (``schedules.get("skippipe")``): the planner prices SkipPipe's
    paths as GPipe over one replica's microbatches (``schedule.select.schedule_of``)."""
    outcome = plan_outcome([*COMMON, "--model", "llama3-8b", "--gpus", "2", "--layout",
                            "pp=2,schedule=skippipe"])  # microbatches: the batch's
    assert outcome.kind == "ok", outcome


# ----- loom plan --mixed FILE: random cluster files ------------------------------------------
PART_VALUES = {
    "gpu": ["A100-80GB", "H100-SXM", "A100-40GB", "B200", "Z80", "", 5, True],
    "gpus": [1, 2, 8, 16, 0, -1, 3, 10**7, "8", 2.5, True],
    "gpus_per_node": [1, 2, 8, 0, 3, -2, 2.5, "x"],
    "intra": ["nvlink3", "pcie5", "nope", 3],
    "inter": ["hdr-ib", "wan-1gbit", "nope", 3],
    "speed": [1],  # not a key of a part
}


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace('"', '') + '"'
    return repr(value)


@st.composite
def mixed_files(draw) -> str:
    """A ``--mixed`` file: 0 to 5 parts of random keys and values, and sometimes a
    ``[between]`` table, another table, or no TOML at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from(["not toml [", "part = 3", "[[part]]\n[[part]]\n", ""]))
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        lines.append("[[part]]")
        if draw(st.integers(0, 2)):  # a sane part, so that whole files often plan
            lines += [f"gpu = {toml_value(draw(st.sampled_from(PART_VALUES['gpu'][:4])))}",
                      f"gpus = {draw(st.sampled_from([8, 16]))}"]
            continue
        keys = draw(st.lists(st.sampled_from(sorted(PART_VALUES)), max_size=5, unique=True))
        keys = [k for k in ("gpu", "gpus") if draw(st.integers(0, 9))] + \
            [k for k in keys if k not in ("gpu", "gpus")]
        lines += [f"{k} = {toml_value(draw(st.sampled_from(PART_VALUES[k])))}" for k in keys]
    between = draw(st.sampled_from([None, "hdr-ib", "wan-10gbit", "tin-can", 5]))
    if between is not None:
        lines += ["[between]", f"link = {toml_value(between)}"]
    if draw(st.integers(0, 9)) == 0:
        lines += ["[nodes]", "x = 1"]
    return "\n".join(lines) + "\n"


@fuzz_settings("plan_mixed")
@given(text=mixed_files(), model=st.sampled_from(["debug", "llama3-8b"]),
       gpus=st.sampled_from([None, 16, 32]))
def test_a_mixed_cluster_file_plans_or_is_refused_on_one_line(tmp_path_factory, text, model,
                                                              gpus):
    path = tmp_path_factory.mktemp("mixed") / "mixed.toml"
    path.write_text(text)
    args = ["plan", "--model", model, "--seq", "256", "--global-batch-tokens", str(64 * 256),
            "--mixed", str(path)] + (["--gpus", str(gpus)] if gpus else [])
    outcome = plan_outcome(args)
    if outcome.kind == "other" and outcome.detail.startswith("exit 1"):
        outcome = harness.Outcome("ok")  # a valid file on which no pipeline fits: exit 1
    check("plan-mixed", outcome, text)
