"""End to end through the real command line: the everyday tools of `loom train`.

``--print-config`` (a TOML that ``--config`` reads back), ``--dry-run`` (every check, then the
memory estimate and the rank grid), ``--help`` (every key), and in one short training run
``metrics.profile_steps`` (a Chrome trace), a stated peak too low for MFU (n/a, one warning), the
ETA, and W&B offline when the package is installed. Each tool that exits early must write
nothing. Runs are one process of the ``debug`` model for a few steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli import main
from loom.config import known_keys, load_config, resolve
from loom.config_help import help_text

SMALL = ["--data.max_bytes=300000", "--data.seq_len=64", "--train.global_batch_size=4",
         "--train.micro_batch_size=2", "--model.preset=debug", "--train.eval_every=0",
         "--optim.warmup_steps=2"]
HAS_WANDB = importlib.util.find_spec("wandb") is not None


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus anything that would make loom think torchrun started it."""
    launcher = {"TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return {**env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONDONTWRITEBYTECODE": "1", **extra}


def loom(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom", *args], cwd=cwd, env=clean_env(**env),
                          text=True, capture_output=True, timeout=300)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# ------------------------------------------------------------------------- exits before launch


def test_print_config_prints_a_toml_that_config_reads_back(tmp_path, capsys) -> None:
    result = loom("train", "--nproc", "2", "--print-config", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: no runs/, no data
    path = tmp_path / "resolved.toml"
    path.write_text(result.stdout)
    config = load_config(path)
    assert config.parallel.dp_replicate == 2 and config.model.vocab_size == 320  # resolved
    assert config.model.n_layers == 4 and config.data.seq_len == 64 and config.train.run_dir == ""
    assert resolve(config, 2) == config  # already resolved: a fixed point
    # round trip: printing the printed config again gives the same text
    assert main(["train", "--config", str(path), "--nproc", "2", "--print-config"]) == 0
    assert capsys.readouterr().out == result.stdout


def test_dry_run_checks_everything_prints_memory_and_grid_and_writes_nothing(tmp_path) -> None:
    before = snapshot(tmp_path)
    result = loom("train", "--nproc", "2", "--dry-run", "--train.run_dir=runs/x", *SMALL,
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("loom train --dry-run: every check passed; nothing was written")
    assert "run dir: runs/x (would be created)" in out
    for component in ("parameters", "gradients", "optimizer", "activations", "total"):
        assert f"\n{component} " in out, component
    assert "limit " in out and ": fits" in out
    assert "RankGrid(dp_replicate=2; 2 ranks)" in out and "dp_replicate groups: [0, 1]" in out
    assert snapshot(tmp_path) == before


def test_dry_run_refuses_what_a_launch_refuses(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the run directory default is relative
    assert main(["train", "--dry-run", "--train.memory_limit_gb=0.0001", *SMALL]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.startswith("loom train: config error: train.memory_limit_gb")
    assert main(["train", "--dry-run", "--train.steps=0", *SMALL]) == 2
    assert "train.steps=0: must be >= 1" in capsys.readouterr().err
    (tmp_path / "taken").write_text("a file, not a directory")
    before = snapshot(tmp_path)
    assert main(["train", "--dry-run", "--train.run_dir=taken", *SMALL]) == 2
    assert "train.run_dir='taken': exists and is not a directory" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_help_lists_every_key_with_its_default_and_description(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--print-config" in out and "--dry-run" in out
    assert help_text() in out
    for key in known_keys():
        section, name = key.split(".")
        assert f"\n  {name} = " in out.split(f"\n[{section}]", 1)[1], key


def test_wandb_without_the_package_is_refused_before_anything_is_written(
        tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib then finds no wandb
    assert main(["train", "--metrics.wandb=true", *SMALL]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and out.out == "", out
    assert lines[0].startswith("loom train: config error: metrics.wandb=True: needs the wandb"
                               " package") and "pip install 'loom[wandb]'" in lines[0]
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- one short run

STEPS = 4


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
    """Steps 2-3 profiled, a stated peak of 1 kFLOP/s (far too low), W&B offline if installed."""
    cwd = tmp_path_factory.mktemp("tools")
    extra = ["--metrics.wandb=true", "--metrics.wandb_project=loom-tests"] if HAS_WANDB else []
    result = loom("train", f"--train.steps={STEPS}", "--train.run_dir=runs/tools",
                  "--metrics.profile_steps=2,3", "--metrics.peak_tflops=1e-9", *extra, *SMALL,
                  cwd=cwd, WANDB_MODE="offline", WANDB_SILENT="true")
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "tools", result


def test_the_profiled_steps_are_a_chrome_trace(tools_run) -> None:
    run_dir, result = tools_run
    trace = json.loads((run_dir / "profile" / "rank0.json").read_text())
    events = trace["traceEvents"]
    assert len(events) > 100 and all("ph" in e for e in events)
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("loom step ")}
    assert steps == {"loom step 2", "loom step 3"}
    assert [p.name for p in (run_dir / "profile").iterdir()] == ["rank0.json"]
    assert "profile: steps 2-3 traced to" in result.stderr


def test_mfu_against_a_peak_too_low_is_na_with_one_warning(tools_run) -> None:
    run_dir, result = tools_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and all(r["mfu"] is None for r in records)
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert "MFU against 1e-09 TFLOP/s per device (metrics.peak_tflops)" in result.stderr
    assert result.stderr.count("warning: MFU came out at") == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS and all("mfu n/a (peak too low)" in line for line in lines)


def test_the_progress_lines_show_an_eta(tools_run) -> None:
    _, result = tools_run
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert "eta" not in lines[0] and "eta" not in lines[-1]  # no pace yet; nothing left
    assert all(" | eta " in line for line in lines[1:-1]), lines


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install loom[wandb])")
def test_wandb_offline_run_is_written_in_the_run_directory(tools_run) -> None:
    run_dir, _ = tools_run
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    from loom.train.trackers import wandb_run_id

    records = offline / f"run-{wandb_run_id(run_dir)}.wandb"  # the id a resume reuses
    data = records.read_bytes()
    assert b"train/loss" in data and b"train/tokens_per_s" in data and b"loom-tests" in data
