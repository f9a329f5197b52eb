"""The Gantt chart files and the Chrome / Perfetto trace carry the timeline in one palette."""

import json

import pytest

from loom.schedule import Op
from loom.schedule.families import get
from loom.schedule import StageCosts, simulate
from loom.schedule.render import OP_CNAMES, OP_COLORS, render_gantt, shade, to_chrome_trace


@pytest.fixture(scope="module")
def zbv():
    schedule = get("zbv")(2, 4)
    return schedule, simulate(schedule, StageCosts.uniform(1, 1, 1, latency=0.5))


def test_every_op_has_a_distinct_colour_and_trace_name():
    assert set(OP_COLORS) == set(OP_CNAMES) == {op.value for op in Op}
    assert len(set(OP_COLORS.values())) == len(set(OP_CNAMES.values())) == len(Op)


def test_later_chunks_are_lighter_shades_of_the_same_colour():
    assert shade("#4387fd", 0, 2) == "#4387fd"
    assert shade("#4387fd", 1, 2) > "#4387fd"  # every channel moved towards ff


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"),
                                            (".html", b"<!DOCTYPE html>")])
def test_gantt_files_in_each_format(tmp_path, zbv, suffix, magic):
    schedule, result = zbv
    path = tmp_path / f"zbv{suffix}"
    render_gantt(schedule, result, path)
    data = path.read_bytes()
    assert data.startswith(magic)
    if suffix == ".html":  # self-contained: the chart is inline, no external references
        assert b"<svg" in data and b"src=" not in data and b"makespan" in data


def test_an_unknown_format_is_refused(tmp_path, zbv):
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.html"):
        render_gantt(*zbv, tmp_path / "chart.pdf")


def test_chrome_trace_has_one_process_per_rank_and_one_event_per_action(zbv):
    schedule, result = zbv
    trace = json.loads(json.dumps(to_chrome_trace(result)))  # plain JSON all the way down
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["pid"] for e in slices}) == list(range(schedule.pp_size))
    assert len(slices) == sum(len(row) for row in schedule.actions)
    first = next(e for e in slices if e["args"]["action"] == "3F0")  # the last stage, back on rank 0
    slot = result.slot(next(a for a in schedule.actions[0] if str(a) == "3F0"))
    assert (first["ts"], first["dur"]) == (slot.start * 1e6, slot.duration * 1e6)
    assert first["cname"] == OP_CNAMES["F"] and first["args"]["chunk"] == 1
    assert {"stage", "microbatch"} <= set(first["args"])
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert max(e["args"]["units"] for e in counters) == max(result.peak_memory)


def test_the_title_names_the_schedule_and_the_subtitle_its_source(tmp_path, zbv):
    from loom.schedule import Schedule
    from loom.schedule.render import title_of

    schedule, _ = zbv
    path = tmp_path / "my_zbv.csv"
    schedule.to_torch_csv(path)
    loaded = Schedule.from_torch_csv(path)  # a CSV has no name: the file's
    assert loaded.name == "my_zbv"
    title, subtitle = title_of(simulate(loaded), source=str(path)).splitlines()
    assert title.startswith("my_zbv  p=2 m=4 v=2") and subtitle.endswith(f"(from {path})")
    assert "from" not in title_of(simulate(loaded)).splitlines()[1]  # no source, no subtitle
