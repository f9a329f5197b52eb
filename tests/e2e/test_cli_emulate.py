"""`loom train --cluster FILE --emulate`: the workers run on an emulated network (one namespace
per rank, the links shaped; needs root), and bad uses are refused with exit 2 and one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli import main

SMALL = ["--train.steps=3", "--model.preset=debug", "--data.max_bytes=100000",
         "--data.seq_len=32", "--train.eval_every=0", "--metrics.progress=false"]
SLOW_LINK = """
[defaults]
latency_ms = 0
bandwidth_gbit = 0.025

[[node]]
name = "a"

[[node]]
name = "b"
"""


def loom(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "loom", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def steps(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "step_time_s" in row]


def _namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    made = subprocess.run(["ip", "netns", "add", "loomprobe-e2e"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "loomprobe-e2e"], capture_output=True)
    return made.returncode == 0


@pytest.mark.skipif(not _namespaces_work(), reason="needs root and network namespaces")
def test_training_on_an_emulated_slow_link_gives_the_same_losses_more_slowly(tmp_path):
    (tmp_path / "cluster.toml").write_text(SLOW_LINK)
    emulated = loom("train", "--nproc", "2", "--cluster", "cluster.toml", "--emulate",
                    "--train.run_dir=runs/emulated", *SMALL, cwd=tmp_path)
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    assert "emulated network: 2 ranks" in emulated.stderr
    plain = loom("train", "--nproc", "2", "--train.run_dir=runs/plain", *SMALL, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    on_link, local = steps(tmp_path / "runs/emulated"), steps(tmp_path / "runs/plain")
    assert [r["loss"] for r in on_link] == [r["loss"] for r in local]
    # 189k fp32 gradients (0.76 MB) all-reduced over 25 Mbit/s: >= 0.24 s a step on the wire.
    # The bucketed all-reduce overlaps the backward, so the step grows by less than the wire
    # time (measured: 0.077 s more at 50 Mbit/s on a 0.09 s step); half of it is the bound, and
    # it is absolute, not a ratio, so a slower machine's longer compute cannot eat the margin.
    assert min(r["step_time_s"] for r in on_link) >= 0.2
    assert min(r["step_time_s"] for r in on_link) > min(r["step_time_s"] for r in local) + 0.12
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "loom" not in namespaces  # removed on exit


SLOW_NODE = """
[defaults]
latency_ms = 0
bandwidth_gbit = 10

[[node]]
name = "fast"

[[node]]
name = "slow"
compute = 0.25
"""


# slow (22 s in CI): the stretch itself is tests/unit/train/test_emulated_speed.py's, and the
# CLI's --emulate path is the slow-link test's above; kept out for the suite's 25 minutes
@pytest.mark.slow
@pytest.mark.skipif(not _namespaces_work(), reason="needs root and network namespaces")
def test_a_slower_node_slows_every_step_to_its_pace(tmp_path):
    (tmp_path / "slow.toml").write_text(SLOW_NODE)
    (tmp_path / "even.toml").write_text(SLOW_NODE.replace("compute = 0.25", "compute = 1.0"))
    times, losses, logs = {}, {}, {}
    for name in ("slow", "even"):
        done = loom("train", "--nproc", "2", "--cluster", f"{name}.toml", "--emulate",
                    f"--train.run_dir=runs/{name}", *SMALL, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = steps(tmp_path / "runs" / name)
        times[name] = sorted(r["step_time_s"] for r in rows)[1]
        losses[name] = [r["loss"] for r in rows]
        logs[name] = done.stderr
    assert "rank speeds 1.0,0.25" in logs["slow"] and "rank speeds" not in logs["even"]
    assert losses["slow"] == losses["even"]  # the slowdown changes time, never numbers
    # rank 1's forward and backward take 4x as long and rank 0 waits for its gradients; the
    # optimizer step, data loading and the all-reduce are not stretched, and on this tiny model
    # they are about half of a step: measured 2.1x on a quiet machine. Only "slower" is asserted
    # here: the ratio shrank to 1.34x under a loaded machine's noise, and how much each piece is
    # stretched is tests/unit/train/test_emulated_speed.py's to check, without wall clocks.
    assert times["slow"] > times["even"], times


@pytest.mark.parametrize("args, words", [
    (["--emulate"], "--emulate=True: needs --cluster FILE"),
    (["--cluster", "cluster.toml"], "is used by loom train only with --emulate"),
    (["--cluster", "missing.toml", "--emulate"], "file does not exist"),
    (["--cluster", "cluster.toml", "--emulate", "--nproc", "4"], "the world has 4"),
])
def test_bad_uses_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys, args,
                                                     words):
    """In process (``loom.cli.main``: no interpreter start per case), as
    ``test_cli_input_refusals.py`` checks the other refusals."""
    (tmp_path / "cluster.toml").write_text(SLOW_LINK)
    monkeypatch.chdir(tmp_path)
    nproc = [] if "--nproc" in args else ["--nproc", "2"]
    code = main(["train", *nproc, *args, "--train.run_dir=runs/x", *SMALL])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert words in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "Traceback" not in out.err
    assert not (tmp_path / "runs").exists()
