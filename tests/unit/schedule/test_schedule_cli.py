"""``loom schedule list | show | export | simulate``, run through ``loom.pipeline.cli.main``."""

import json

import pytest

from loom.schedule import Schedule, validate
from loom.pipeline.cli import main
from loom.schedule.families import get, names, routed, simulation_only


def run(capsys, *argv):
    code = main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_shows_every_family_and_which_take_chunks(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert set(lines) == set(names()) | set(routed()) | set(simulation_only())
    assert "[--chunks]" in lines["interleaved_1f1b"] and "[--chunks]" not in lines["1f1b"]


def test_simulate_json_has_makespan_bubbles_and_peak_memory(capsys):
    code, out, _ = run(capsys, "simulate", "1f1b", "--pp", "4", "--microbatches", "8",
                       "--costs", "1,0.5,0.5", "--json")
    assert code == 0
    figures = json.loads(out)
    assert figures["makespan"] == (8 + 4 - 1) * 2  # (m+p-1)(T_F+T_B)
    assert figures["bubble_zb"] == figures["bubble_makespan"] == pytest.approx(3 / 11)
    assert figures["peak_memory"] == [4, 3, 2, 1]


def test_simulate_prints_the_figures_and_takes_latency_and_chunks(capsys):
    code, out, _ = run(capsys, "simulate", "interleaved_1f1b", "--pp", "2", "-m", "4",
                       "--chunks", "3", "--costs", "1,1,1,0.25")
    assert code == 0
    assert "makespan" in out and "bubble (ZB)" in out and "peak memory" in out
    assert "latency=0.25" in out and "stages=6" in out


def test_simulate_reads_a_per_stage_cost_file_and_writes_the_full_result(capsys, tmp_path):
    costs = tmp_path / "costs.csv"
    costs.write_text("F,I,W\n1,1,1\n3,1,1\n")
    result = tmp_path / "result.json"
    code, _, _ = run(capsys, "simulate", "gpipe", "--pp", "2", "-m", "2",
                     "--cost-file", str(costs), "-o", str(result))
    assert code == 0
    data = json.loads(result.read_text())
    assert data["busy"] == [2 * (1 + 2), 2 * (3 + 2)] and len(data["timeline"]) == 2


def test_export_writes_torch_csv_and_json_that_load_back(capsys, tmp_path):
    csv_path, json_path = tmp_path / "zbv.csv", tmp_path / "zbv.json"
    assert run(capsys, "export", "zbv", "--pp", "4", "-m", "8", "-o", str(csv_path))[0] == 0
    assert run(capsys, "export", "zbv", "--pp", "4", "-m", "8", "--format", "json",
               "-o", str(json_path))[0] == 0
    from_csv = Schedule.from_torch_csv(csv_path, num_microbatches=8)
    from_json = Schedule.from_json(json_path.read_text())
    validate(from_csv)
    assert from_json == get("zbv")(4, 8)
    assert from_csv.actions == from_json.actions and from_csv.placement == from_json.placement
    # an exported file is a schedule name too
    code, out, _ = run(capsys, "simulate", str(json_path), "--json")
    assert code == 0 and json.loads(out)["bubble_zb"] == 0


def test_export_to_stdout_defaults_to_torch_csv(capsys):
    code, out, _ = run(capsys, "export", "1f1b", "--pp", "2", "-m", "2")
    assert code == 0 and out.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]


def test_show_prints_the_grid_or_draws_a_chart(capsys, tmp_path):
    code, out, _ = run(capsys, "show", "1f1b", "--pp", "2", "-m", "3")
    assert code == 0 and "rank 1" in out and "0B0" in out
    chart, trace = tmp_path / "chart.svg", tmp_path / "trace.json"
    assert run(capsys, "show", "zb_h1", "--pp", "2", "-m", "4", "-o", str(chart))[0] == 0
    assert chart.read_text().startswith("<?xml")
    assert run(capsys, "show", "zb_h1", "--pp", "2", "-m", "4", "-o", str(trace))[0] == 0
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.timeout(30)
def test_a_search_over_more_ranks_than_it_finishes_in_seconds_is_refused(capsys):
    """The search's time grows faster than the ranks (1,024 ranks took 24 s, 2,048 52 s): at
    100,000 ranks of one microbatch, within the step-size bound, it ran for hours."""
    code, _, err = run(capsys, "search", "--pp", "100000", "-m", "1", "--memory-limit", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--pp" in err and "at most 512 ranks" in err


@pytest.mark.parametrize("argv, flag, rule", [
    (["--memory-limit", "0.5"], "--memory-limit", "below the minimum of 1 unit"),
    (["--memory-limit", "4", "--placement", "v", "--layers", "5"], "--layers",
     "more than max_chunks=1"),
    (["--memory-limit", "4", "--pp", "600", "-m", "1"], "--pp", "at most 512 ranks"),
])
def test_a_search_refusal_names_the_flag_the_search_names(capsys, argv, flag, rule):
    """``SearchError.argument`` (the search's parameter) becomes the command's flag."""
    code, _, err = run(capsys, "search", *(["--pp", "4"] if "--pp" not in argv else []), *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"loom schedule search: {flag}: ") and rule in err, err


def test_a_search_refusal_about_the_costs_names_the_cost_file(capsys, tmp_path):
    costs = tmp_path / "costs.csv"
    costs.write_text("F,I,W\n1,1,1\n3,1,1\n1,1,1\n")  # 3 stages for 4 ranks
    code, _, err = run(capsys, "search", "--pp", "4", "--memory-limit", "4", "--cost-file",
                       str(costs))
    assert code == 2 and err.startswith("loom schedule search: --cost-file: costs: give one F,I,W"
                                        " for every stage or one per rank (4), got 3"), err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [["--pp", "64", "-m", "64"], ["--pp", "256", "-m", "1"]])
def test_a_chart_too_large_to_draw_in_a_minute_is_refused_before_drawing(capsys, tmp_path, size):
    """Drawing takes about 10 ms per action (159 s for 8,192 over 64 ranks; 256 ranks of one
    microbatch took 168 s): beyond 32 ranks or 4,096 actions ``-o`` refuses in one line and
    names the Chrome trace, which writes at any size."""
    chart = tmp_path / "chart.png"
    code, _, err = run(capsys, "show", "1f1b", *size, "-o", str(chart))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "at most 32 ranks and 4,096 actions" in err and ".json Chrome trace" in err
    assert not chart.exists()
    trace = tmp_path / "trace.json"
    assert run(capsys, "show", "1f1b", *size, "-o", str(trace))[0] == 0 and trace.exists()


@pytest.mark.parametrize("argv, argument", [
    (["simulate", "1f1b", "--pp", "0"], "--pp"),
    (["simulate", "1f1b", "--pp", "x"], "--pp"),
    (["simulate", "1f1b"], "--pp"),
    (["simulate", "interleaved_1f1b", "--pp", "4", "-m", "3"], "--microbatches"),
    (["simulate", "1f1b", "--pp", "4", "--chunks", "2"], "--chunks"),
    (["simulate", "1f1b", "--pp", "4", "--costs", "1,2"], "--costs"),
    (["simulate", "1f1b", "--pp", "4", "--cost-file", "/nonexistent.csv"], "--cost-file"),
    (["simulate", "zb_h2", "--pp", "4", "--memory-limit", "4"], "--memory-limit"),
    (["export", "zb_h2", "--pp", "4", "--memory-limit", "6.5"], "--memory-limit"),
    (["simulate", "no_such_schedule", "--pp", "4"], "name"),
    (["show", "1f1b", "--pp", "2", "-o", "chart.pdf"], "-o"),
    # hostile sizes and paths: refused before any work, not a traceback or an hour of Python
    (["simulate", "1f1b", "--pp", "4", "--costs", "1e308,1e308,1"], "--costs"),
    (["show", "1f1b", "--pp", "100000", "-m", "100000"], "--pp"),
    (["search", "--pp", "100000", "-m", "8", "--memory-limit", "10"], "--pp"),
    (["search", "--pp", "4", "-m", "8", "--memory-limit", "inf"], "--memory-limit"),
    (["search", "--pp", "4", "-m", "8", "--memory-limit", "nan"], "--memory-limit"),
    (["simulate", "zbv", "--pp", "4", "--memory-limit", "infinity"], "--memory-limit"),
    (["export", "zbv", "--pp", "4", "-m", "8", "-o", "/"], "-o"),
    (["export", "zbv", "--pp", "4", "-m", "8", "-o", "/nonexistent/dir/x.csv"], "-o"),
    (["show", "zbv", "--pp", "4", "-m", "8", "-o", "/proc/x.png"], "/proc/x.png"),
    (["export", "zbv", "--pp", "4", "-m", "8", "-o", "/dev/full"], "/dev/full"),  # a full disk
])
def test_a_bad_argument_is_one_line_naming_it_and_exit_code_2(capsys, argv, argument):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert argument in err


@pytest.mark.parametrize("layers, chunks", [(8, 1), (15, 1), (16, 2), (40, 5), (1000, 8)])
def test_search_layers_bound_the_stages_per_rank(capsys, layers, chunks):
    """``--layers N``: at most N // --pp stages per rank (and the search's own 8), as
    ``parallel.schedule = "search"`` does with the model's layers."""
    code, out, _ = run(capsys, "search", "--pp", "8", "-m", "16", "--memory-limit", "16",
                       "--layers", str(layers), "--effort", "20000", "--json")
    assert code == 0
    found = json.loads(out)
    assert found["chunks"] <= chunks
    assert all(entry["chunks"] <= chunks for entry in found["leaderboard"])
    if chunks == 1:
        assert found["placement"] == "looped"


@pytest.mark.parametrize("argv", [
    ["--layers", "7"],  # fewer layers than ranks
    ["--layers", "15", "--placement", "v"],  # V needs two stages per rank: 16 layers
    ["--layers", "0"],
])
def test_search_refuses_layers_that_cannot_hold_the_placement(capsys, argv):
    code, _, err = run(capsys, "search", "--pp", "8", "--memory-limit", "8", *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "--layers" in err


def test_the_memory_limit_passes_when_the_peak_fits(capsys):
    code, _, _ = run(capsys, "simulate", "zb_h2", "--pp", "4", "--memory-limit", "7")
    assert code == 0


# -- one meaning of --costs: a full stage's durations, split over a rank's chunks ---------------


def _durations(timeline):
    """{op letter: set of slot durations} over a simulated timeline (``SimResult.to_dict``)."""
    found = {}
    for row in timeline:
        for action, start, finish in row:
            op = action.strip("0123456789")
            found.setdefault(op, set()).add(finish - start)
    return found


def test_costs_are_full_stage_costs_in_show_simulate_and_search(capsys, tmp_path):
    costs = "2,3,1"  # F, I, W of one full stage; zbv holds 2 chunks per rank: each takes half
    result = tmp_path / "result.json"
    assert run(capsys, "simulate", "zbv", "--pp", "4", "-m", "8", "--costs", costs,
               "-o", str(result))[0] == 0
    assert _durations(json.loads(result.read_text())["timeline"]) == {
        "F": {1}, "I": {1.5}, "W": {0.5}}

    trace = tmp_path / "trace.json"
    assert run(capsys, "show", "zbv", "--pp", "4", "-m", "8", "--costs", costs,
               "-o", str(trace))[0] == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {(e["cat"], e["dur"] / 1e6) for e in events} == {("F", 1), ("I", 1.5), ("W", 0.5)}

    # search reads the same flag the same way: its schedule, simulated by `simulate` with the
    # same --costs, takes exactly the makespan the search reported
    searched = tmp_path / "searched.json"
    code, out, _ = run(capsys, "search", "--pp", "4", "-m", "8", "--costs", costs,
                       "--memory-limit", "4", "--placement", "v", "-o", str(searched), "--json")
    assert code == 0
    reported = json.loads(out)["makespan"]
    code, out, _ = run(capsys, "simulate", str(searched), "--costs", costs, "--json")
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(reported)


def test_costs_of_a_one_chunk_family_are_used_as_given(capsys, tmp_path):
    result = tmp_path / "result.json"
    assert run(capsys, "simulate", "1f1b", "--pp", "4", "-m", "8", "--costs", "2,3,1",
               "-o", str(result))[0] == 0
    assert _durations(json.loads(result.read_text())["timeline"]) == {"F": {2}, "B": {4}}


def test_a_cost_file_gives_every_global_stage_as_it_is(capsys, tmp_path):
    costs = tmp_path / "costs.csv"  # zbv at p=2: 4 global stages, no split
    costs.write_text("F,I,W\n1,1,1\n2,1,1\n2,1,1\n1,1,1\n")
    result = tmp_path / "result.json"
    assert run(capsys, "simulate", "zbv", "--pp", "2", "-m", "4", "--cost-file", str(costs),
               "-o", str(result))[0] == 0
    assert _durations(json.loads(result.read_text())["timeline"])["F"] == {1, 2}


# -- the per-rank summary of wide pipelines -------------------------------------------------------


def _bar_lines(out):
    """The summary's per-rank lines: a rank number, then a bar of '#' (busy) and '.' (idle)."""
    return [line for line in out.splitlines()
            if len(line.split()) == 4 and line.split()[0].isdigit()
            and set(line.split()[1]) <= {"#", "."}]


def test_from_16_ranks_show_prints_utilisation_bars_and_peak_memory_per_rank(capsys):
    code, out, _ = run(capsys, "show", "1f1b", "--pp", "16", "-m", "32")
    assert code == 0
    assert "rank 0 " not in out  # no step grid
    bars = _bar_lines(out)
    assert len(bars) == 16
    for rank, line in enumerate(bars):
        index, bar, busy, peak = line.split()
        assert int(index) == rank
        assert len(bar) == 40 and set(bar) <= {"#", "."}
        assert busy.endswith("%") and float(peak) == 16 - rank  # 1F1B: p - r in flight
        # the bar is the busy fraction, rounded to the bar's 40 characters
        assert bar.count("#") == round(float(busy[:-1]) / 100 * 40)
    assert "mean utilisation" in out


def test_gantt_asks_for_the_grid_and_summary_for_the_bars_at_any_size(capsys):
    code, out, _ = run(capsys, "show", "1f1b", "--pp", "16", "-m", "16", "--gantt")
    assert code == 0 and "rank 15 " in out and not _bar_lines(out)
    code, out, _ = run(capsys, "show", "1f1b", "--pp", "4", "-m", "8")
    assert code == 0 and "rank 3 " in out and not _bar_lines(out)  # small: the grid by default
    code, out, _ = run(capsys, "simulate", "1f1b", "--pp", "4", "-m", "8", "--summary")
    assert code == 0 and len(_bar_lines(out)) == 4 and "makespan" in out
    code, out, _ = run(capsys, "simulate", "1f1b", "--pp", "16", "-m", "16")
    assert code == 0 and len(_bar_lines(out)) == 16 and "busy     " not in out
    code, out, _ = run(capsys, "simulate", "1f1b", "--pp", "4", "-m", "8", "--gantt")
    assert code == 0 and "rank 3 " in out and "busy" in out


# -- titles name the schedule ---------------------------------------------------------------------


def test_a_chart_drawn_from_a_csv_is_titled_with_the_schedules_name(capsys, tmp_path):
    csv_path = tmp_path / "hanayo.csv"
    assert run(capsys, "export", "hanayo", "--pp", "2", "-m", "4", "-o", str(csv_path))[0] == 0
    page = tmp_path / "chart.html"
    assert run(capsys, "show", str(csv_path), "-o", str(page))[0] == 0
    text = page.read_text()
    assert "<title>hanayo pipeline schedule</title>" in text and "<h2>hanayo " in text
    assert "torch_csv" not in text and f"from {csv_path}" in text  # the source: a subtitle


@pytest.mark.parametrize("content", ['[{"F": 1, "I": 1, "W": 1}]', '{"stages": [[1, 1, 1]]}',
                                     '{"stages": [{"F": NaN, "I": 1, "W": 1}]}',
                                     '{"stages": [{"F": 1e308, "I": 1, "W": 1}]}',
                                     '{"stages": [{"F": true, "I": 1, "W": 1}]}', '{"stages": 3}',
                                     # a number or a string where a list belongs (5 raised
                                     # TypeError; "11" was read as the list [1, 1])
                                     '{"stages": [{"F": 1, "I": 1, "W": 1}], "activation": 5}',
                                     '{"stages": [{"F": 1, "I": 1, "W": 1}], "activation": "11"}'])
def test_a_hostile_cost_file_is_one_line_naming_it(capsys, tmp_path, content):
    path = tmp_path / "costs.json"
    path.write_text(content)
    for argv in (["simulate", "gpipe", "--pp", "2", "-m", "2"],
                 ["search", "--pp", "2", "-m", "2", "--memory-limit", "4"]):
        code, _, err = run(capsys, *argv, "--cost-file", str(path))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--cost-file" in err, err


@pytest.mark.parametrize("change, message", [
    ({"num_stages": "2"}, "num_stages='2': must be an integer"),
    ({"num_microbatches": 2.0}, "num_microbatches=2.0: must be an integer"),
    ({"placement": "ab"}, "placement='ab': must be a list"),
    ({"actions": [[1], [2]]}, "actions must be a list of rows"),
    # a step the file's actions cannot hold would only make the checks run for ever
    ({"num_microbatches": 10**12}, "num_microbatches=1000000000000 x 2 stages"),
    # counts and actions outside the declared grid (tracebacks in the validator's grid before)
    ({"num_microbatches": -5}, "num_microbatches=-5: must be >= 1"),
    ({"num_stages": 0, "placement": []}, "num_stages=0: must be >= 1"),
    ({"actions": [["100000000000000000000F0"], ["1F0"]]},
     "rank 0's 100000000000000000000F0 is outside num_stages=2"),
])
def test_a_hostile_schedule_file_is_one_line_naming_the_field(capsys, tmp_path, change, message):
    data = {**get("1f1b")(2, 4).to_dict(), **change}
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, "simulate", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_schedule_csv_with_a_huge_cell_is_one_line(capsys, tmp_path):
    """A cell past the csv module's 128 KiB limit raised its own error."""
    huge_cell = tmp_path / "cell.csv"
    huge_cell.write_text("0F0," + "x" * 200_000 + "\n1F0,1B0\n")
    code, _, err = run(capsys, "show", str(huge_cell))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(huge_cell) in err and "not a readable CSV" in err, err
    code, _, err = run(capsys, "simulate", "gpipe", "--pp", "2", "-m", "2", "--cost-file",
                       str(huge_cell))
    assert code == 2 and "--cost-file" in err and "not a readable CSV" in err, err


@pytest.mark.timeout(30)
def test_a_schedule_file_of_many_ranks_is_read_in_linear_time(capsys, tmp_path):
    """``stages_of`` scanned the whole placement for every rank: 20,000 ranks took 9 s here,
    40,000 would take about 36 s; now a few."""
    many = tmp_path / "many.csv"
    many.write_text("".join(f"{r}F0,{r}B0\n" for r in range(40_000)))
    code, out, err = run(capsys, "show", str(many))
    assert code == 0 and "40000 ranks" in out, err


def test_a_schedule_file_is_held_to_the_families_step_size():
    """A file is refused past ``MAX_STEP_CELLS`` as a family is, naming the file."""
    from loom.pipeline.cli import MAX_STEP_CELLS, UsageError, _check_size

    _check_size(MAX_STEP_CELLS, 1, 1, "the file's", file="many.csv")
    with pytest.raises(UsageError, match=r"^many.csv: 400000 ranks x 3 microbatches x 1 stages"):
        _check_size(400_000, 3, 1, "the file's", file="many.csv")


def test_a_broken_schedule_file_is_one_line_and_the_grid_on_request(capsys, tmp_path):
    data = get("1f1b")(2, 4).to_dict()
    data["actions"][0].reverse()  # every backward before its forward
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, "simulate", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "[order]" in err, err
    assert "--gantt" in err  # says how to see where
    code, _, err = run(capsys, "show", str(path), "--gantt")
    assert code == 2 and "rank 0" in err and "[order]" in err.strip().splitlines()[-1], err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family, pp, chunks", [("zbv", 5000, 0), ("hanayo", 30000, 4)])
def test_a_deep_pipeline_of_few_microbatches_costs_its_actions(family, pp, chunks):
    """ZB-V below 2p - 1 microbatches is generated for 2p - 1 and cut (as torch's is): it made
    all of them, p^2 actions, and ``loom schedule simulate zbv --pp 5000 -m 2`` ran past 200 s;
    it now makes only those it keeps (``RankWriter.repeat``; the same orders as the old code on
    372 sizes). Hanayo's wave visited every rank in every slot: 10,000 ranks of 2 microbatches
    took 11 s to generate, 30,000 would take about 100 s. Each takes seconds now; the timeout
    catches the old cost."""
    from loom.schedule.families import get

    made = get(family)(pp, 2, **({"chunks": chunks} if chunks else {}))
    per_rank = chunks or 2
    assert sum(map(len, made.actions)) == pp * per_rank * 2 * (3 if family == "zbv" else 2)
