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
])
def test_a_bad_argument_is_one_line_naming_it_and_exit_code_2(capsys, argv, argument):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert argument in err


def test_the_memory_limit_passes_when_the_peak_fits(capsys):
    code, _, _ = run(capsys, "simulate", "zb_h2", "--pp", "4", "--memory-limit", "7")
    assert code == 0
