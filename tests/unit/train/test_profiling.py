"""Specifications for loom.train.profiling: which steps a trace holds, and when it is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.train.profiling import StepProfiler


def run_steps(profiler: StepProfiler, steps: range, fail_at: int | None = None) -> None:
    a = torch.randn(64, 64)
    with profiler:
        for step in steps:
            profiler.begin(step)
            if step == fail_at:
                raise RuntimeError("boom")
            a = torch.tanh(a @ a)
            profiler.end(step)


def traced_steps(path: Path) -> list[int]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({int(e["name"].split()[-1]) for e in events
                   if str(e.get("name", "")).startswith("loom step ")})


def test_the_inclusive_range_is_traced_once_per_rank(tmp_path) -> None:
    logged: list[str] = []
    profiler = StepProfiler((2, 3), tmp_path, rank=1, device=torch.device("cpu"),
                            log=logged.append)
    run_steps(profiler, range(1, 6))
    path = tmp_path / "profile" / "rank1.json"
    assert profiler.written == path and traced_steps(path) == [2, 3]
    assert [p.name for p in path.parent.iterdir()] == ["rank1.json"]  # no temporary left
    assert logged == [f"profile: steps 2-3 traced to {path.parent}/rank<r>.json (one Chrome"
                      " trace per rank)"]


def test_one_step_a_resumed_run_and_an_early_stop(tmp_path) -> None:
    one = StepProfiler((4,), tmp_path / "one", 0, torch.device("cpu"), log=lambda _: None)
    run_steps(one, range(1, 6))
    assert traced_steps(tmp_path / "one" / "profile" / "rank0.json") == [4]
    resumed = StepProfiler((2, 4), tmp_path / "resumed", 0, torch.device("cpu"),
                           log=lambda _: None)
    run_steps(resumed, range(3, 6))  # resumed from step 2's checkpoint: 3 and 4 are left
    assert traced_steps(tmp_path / "resumed" / "profile" / "rank0.json") == [3, 4]
    stopped = StepProfiler((2, 9), tmp_path / "stopped", 0, torch.device("cpu"),
                           log=lambda _: None)
    run_steps(stopped, range(1, 4))  # preempted after step 3: the steps it had
    assert traced_steps(tmp_path / "stopped" / "profile" / "rank0.json") == [2, 3]


def test_nothing_is_written_outside_the_range_without_steps_or_on_failure(tmp_path) -> None:
    past = StepProfiler((1, 2), tmp_path / "past", 0, torch.device("cpu"), log=lambda _: None)
    run_steps(past, range(3, 5))  # resumed past the range
    off = StepProfiler((), tmp_path / "off", 0, torch.device("cpu"), log=lambda _: None)
    run_steps(off, range(1, 3))
    failed = StepProfiler((1, 3), tmp_path / "failed", 0, torch.device("cpu"),
                          log=lambda _: None)
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(failed, range(1, 4), fail_at=2)
    assert not any(tmp_path.rglob("*.json")) and failed.written is None
