"""Hostile values a review of every command's input path found crashing, hanging or slipping
through (2026-11-28), each now refused in one line naming the field and the rule, exit 2,
before anything is written: integers beyond any float or int64, NaN and infinity in the
hardware catalog, tables where names belong, superscript digits, a cost whose exponent
would take hours to expand, counts that overflow, a seed torch cannot take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom import cli

PLAN = ["plan", "--model", "tiny", "--gpus", "4", "--seq", "256",
        "--global-batch-tokens", "4096"]
HUGE = "1" + "0" * 400  # a TOML integer: no float holds it


def refusal(capsys, argv: list[str]) -> str:
    """Run ``loom argv`` in-process; the one line it refused with (exit 2)."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("override, field, rule", [
    ("--train.seed=-1", "train.seed", ">= 0"),
    ("--train.timeout_s=1e14", "train.timeout_s", "<= 1e+09"),
    ("--train.preempt_grace_s=1e14", "train.preempt_grace_s", "<= 1e+09"),
    ("--train.threads=5000", "train.threads", "<= 4096"),
    (f"--train.threads={10 ** 30}", "train.threads", "64-bit integer"),
    (f"--train.steps={10 ** 19}", "train.steps", "64-bit integer"),
    # every rank builds RoPE tables of max_seq_len positions: 10^12 asked for petabytes
    (f"--model.max_seq_len={10 ** 12}", "model.max_seq_len", "<= 16,777,216"),
])
def test_train_refuses_values_its_workers_could_not_take(capsys, tmp_path, override, field, rule):
    err = refusal(capsys, ["train", "--dry-run", f"--train.run_dir={tmp_path / 'run'}",
                           override])
    assert field in err and rule in err
    assert not (tmp_path / "run").exists()


def test_a_config_float_written_as_a_huge_integer_is_refused(capsys, tmp_path):
    (tmp_path / "c.toml").write_text(f"[optim]\nlr = {HUGE}\n")
    err = refusal(capsys, ["train", "--dry-run", "--config", str(tmp_path / "c.toml")])
    assert "optim.lr" in err and "finite number" in err


@pytest.mark.parametrize("link, field", [
    ('between = [["a"], "b"]\nlatency_ms = 1\nbandwidth_gbit = 1', "cluster.link[0]"),
    (f'between = ["a", "b"]\nlatency_ms = {HUGE}\nbandwidth_gbit = 1',
     "cluster.link[0].latency_ms"),
])
def test_a_cluster_file_with_a_list_for_a_name_or_a_huge_number_is_refused(capsys, tmp_path,
                                                                            link, field):
    (tmp_path / "c.toml").write_text(
        "[defaults]\nlatency_ms = 1\nbandwidth_gbit = 1\n[[node]]\nname = \"a\"\n"
        f"[[node]]\nname = \"b\"\n[[link]]\n{link}\n")
    err = refusal(capsys, ["train", "--dry-run", "--nproc", "2", "--cluster",
                           str(tmp_path / "c.toml"), "--emulate"])
    assert field in err


@pytest.mark.parametrize("catalog, names", [
    ("gpu = 5", "[gpu] must be a table"),
    ("[gpu]\nX = 5", "[gpu.X] must be a table"),
    ('[gpu.X]\npeak_flops = 1e15\nhbm_gbps = 3000\nmemory_gb = "abc"', "memory_gb"),
    ("cluster = 5", "[cluster] must be a table"),
    ('[cluster]\ngpus_per_node = "x"', "gpus_per_node"),
    ("[gpu.A100-80GB]\npeak_flops = nan\nmemory_gb = 80\nhbm_gbps = 2000", "peak_flops"),
    ("[gpu.A100-80GB]\npeak_flops = 1e15\nmemory_gb = inf\nhbm_gbps = 2000", "memory_bytes"),
    ("[link.nvlink3]\nbandwidth_gbps = nan\nlatency_us = 1", "bandwidth"),
    ('[cluster]\nintra = ["nvlink3"]', "--intra"),
])
def test_a_hardware_catalog_with_hostile_entries_is_refused(capsys, tmp_path, catalog, names):
    (tmp_path / "hw.toml").write_text(catalog + "\n")
    err = refusal(capsys, [*PLAN, "--gpu", "A100-80GB", "--hardware", str(tmp_path / "hw.toml")])
    assert names in err


@pytest.mark.parametrize("profile, names", [
    ("{}", "calibration profile"),
    ("[1]", "calibration profile"),
    ('{"gpu": {"x": 1}, "link": {}}', "'x'"),
    ('{"gpu": {"name": "g", "peak_flops": 1e12, "memory_bytes": 1e9, "hbm_bandwidth": "x"},'
     ' "link": {"name": "l", "bandwidth": 1, "latency": 0}}', "hbm_bandwidth"),
    ("[" * 100_000, "is not valid JSON"),
])
def test_a_broken_calibration_profile_is_refused(capsys, tmp_path, profile, names):
    (tmp_path / "p.json").write_text(profile)
    err = refusal(capsys, [*PLAN, "--gpu", "local", "--profile", str(tmp_path / "p.json")])
    assert "--profile" in err and names in err


def test_a_length_distribution_with_superscript_digits_or_huge_counts_is_refused(capsys,
                                                                                 tmp_path):
    for text in ("128\n²\n", f"128 {10 ** 30}\n"):
        (tmp_path / "lengths.txt").write_text(text)
        err = refusal(capsys, [*PLAN, "--gpu", "A100-80GB", "--length-dist",
                               str(tmp_path / "lengths.txt")])
        assert "--length-dist" in err and "line" in err


@pytest.mark.parametrize("explain", ["0", "-1"])
def test_plan_explains_a_rank_of_the_table_only(capsys, explain):
    err = refusal(capsys, [*PLAN, "--gpu", "A100-80GB", "--top", "1", "--explain", explain])
    assert f"--explain {explain}" in err


def test_plan_explains_no_rank_past_the_table_it_will_print(capsys):
    err = refusal(capsys, [*PLAN, "--gpu", "A100-80GB", "--top", "2", "--explain", "3"])
    assert err.strip() == "loom plan: --explain 3: a rank of the table, 1 to --top 2"


def test_plan_explains_no_rank_past_the_layouts_that_ranked_and_writes_nothing(capsys,
                                                                             tmp_path):
    out = tmp_path / "plan.toml"  # one GPU: four microbatch splits rank, not the 20 asked for
    err = refusal(capsys, ["plan", "--model", "tiny", "--gpus", "1", "--seq", "256",
                           "--global-batch-tokens", "4096", "--top", "20", "--explain", "5",
                           "-o", str(out)])
    assert err.strip() == "loom plan: --explain 5: the table has 4 rows"
    assert not out.exists()


@pytest.mark.parametrize("command", ["search", "simulate"])
def test_a_stage_that_takes_no_time_is_refused(capsys, tmp_path, command):
    """All-zero costs gave a makespan of 0 and a peak memory of 0 on every rank (each
    microbatch was live for no time), which no schedule has."""
    family = [] if command == "search" else ["1f1b"]
    limit = ["--memory-limit", "4"] if command == "search" else []
    err = refusal(capsys, ["schedule", command, *family, "--pp", "4", "-m", "8", *limit,
                           "--costs", "0,0,0,0.1"])
    assert "--costs: 0,0,0,0.1: F, I and W are all 0" in err
    stages = tmp_path / "costs.csv"
    stages.write_text("F,I,W\n1,1,1\n0,0,0\n1,1,1\n1,1,1\n")
    err = refusal(capsys, ["schedule", command, *family, "--pp", "4", "-m", "8", *limit,
                           "--cost-file", str(stages)])
    assert "--cost-file: stages[1]: F, I and W are all 0" in err


@pytest.mark.parametrize("argv, flag", [
    (["bitpipe", "--pp", "3", "-m", "6"], "--pp"),  # its rule explains itself in microbatches
    (["bitpipe", "--pp", "4", "-m", "6"], "--microbatches"),
    (["hanayo", "--pp", "4", "-m", "8", "--chunks", "3"], "--chunks"),
])
def test_a_family_s_refusal_names_the_flag_it_is_about(capsys, argv, flag):
    err = refusal(capsys, ["schedule", "simulate", *argv])
    assert err.startswith(f"loom schedule simulate: {flag}: ")


@pytest.mark.parametrize("layout, message", [
    ("pp=2,pp=4", "--layout pp: given twice"),  # the last one used to win quietly
    ("dp_replicate=4,sequence_parallel=ture", "--layout sequence_parallel=ture: must be true or"
                                              " false"),  # a typo used to mean false
])
def test_plan_refuses_a_layout_field_given_twice_or_a_flag_that_is_not_a_bool(capsys, layout,
                                                                             message):
    err = refusal(capsys, [*PLAN, "--gpu", "A100-80GB", "--layout", layout])
    assert err.strip() == f"loom plan: {message}"


def test_plan_refuses_a_nan_limit_in_a_layout(capsys):
    err = refusal(capsys, [*PLAN, "--gpu", "A100-80GB", "--layout",
                           "dp_replicate=4,schedule_memory_limit=nan"])
    assert "schedule_memory_limit" in err and "finite" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("costs", ["1e999999999,1,1", "1e-999999999,1,1", "1" * 100 + ",1,1"])
def test_a_cost_that_would_take_hours_to_expand_is_refused_at_once(capsys, costs):
    err = refusal(capsys, ["schedule", "simulate", "1f1b", "--pp", "4", "-m", "4",
                           "--costs", costs])
    assert "--costs" in err and "exponent" in err


def test_generate_refuses_a_seed_torch_cannot_take(capsys, tmp_path):
    err = refusal(capsys, ["generate", "--run", str(tmp_path), "--seed", str(10 ** 30)])
    assert "--seed" in err


@pytest.mark.parametrize("meta", ["{}", "[1]", '{"kind": "bpe", "vocab_size": null}',
                                  '{"kind": "bpe", "vocab_size": 1e999}', "not json"])
def test_a_broken_tokenizer_description_is_a_value_error_naming_the_file(tmp_path, meta):
    from loom.data.tokenizer import META_FILE, load_tokenizer

    (tmp_path / META_FILE).write_text(meta)
    with pytest.raises(ValueError, match=META_FILE):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("meta", ["{}", "[1]", '{"eos_id": "x"}', "not json"])
def test_hf_export_refuses_a_broken_tokenizer_description(tmp_path, meta):
    from loom.hf_cli import _tokenizer_ids
    from loom.models.hf import HFConversionError

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer_meta.json").write_text(meta)
    with pytest.raises(HFConversionError, match="tokenizer_meta.json"):
        _tokenizer_ids(tmp_path)


@pytest.mark.parametrize("change", [{"num_tokens": 1e999}, {"num_tokens": 2.5},
                                    {"num_docs": -1}, {"dtype": "O"}])
def test_a_prepared_manifest_with_hostile_counts_is_refused(tmp_path, change):
    import math

    import numpy as np

    from loom.data.prepare import (FORMAT, INDEX_FILE, PREPARED_MANIFEST, TOKENS_FILE, VERSION,
                                   PreparedData)
    from loom.errors import ConfigError

    manifest = {"format": FORMAT, "version": VERSION, "dtype": "uint16", "num_tokens": 4,
                "num_docs": 1, "tokenizer": {"identity": "x"}, **change}
    text = json.dumps(manifest).replace("Infinity", "1e999")
    (tmp_path / PREPARED_MANIFEST).write_text(text)
    # the files as long as int() of the counts says (what a check of the sizes alone accepts),
    # so that only the checks of the counts and the dtype can refuse
    tokens, docs = manifest["num_tokens"], manifest["num_docs"]
    if math.isfinite(tokens):
        (tmp_path / TOKENS_FILE).write_bytes(bytes(int(tokens) * np.dtype(manifest["dtype"])
                                                   .itemsize))
        (tmp_path / INDEX_FILE).write_bytes(bytes(max(int(docs) + 1, 0) * 8))
    with pytest.raises(ConfigError, match="data.source"):
        PreparedData.open(Path(tmp_path), str(tmp_path))


@pytest.mark.timeout(30)
def test_a_deep_pipeline_is_estimated_in_seconds(capsys):
    """Every rank's memory profile rescaled every stage's weight, and the layer partition held
    stages x layers tables (8,192 ranks: 76 s and 1.3 GB here); now the weights are scaled once
    per schedule and the tables hold the reachable band."""
    code = cli.main(["estimate-memory", "--nproc=8192", "--parallel.pp=8192",
                     "--model.n_layers=8192"])
    assert code == 0 and "pipeline rank" in capsys.readouterr().out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pp, layers", [(1000, 2000), (2, 4000)])
def test_a_layer_split_that_would_take_minutes_is_refused(capsys, pp, layers):
    """The exact partition is a dynamic program of stages x (layers - stages + 1)^2 steps."""
    err = refusal(capsys, ["estimate-memory", f"--nproc={pp}", f"--parallel.pp={pp}",
                           f"--model.n_layers={layers}"])
    assert f"model.n_layers={layers}" in err and "exact layer partition" in err


@pytest.mark.timeout(30)
def test_plan_refuses_more_accelerators_than_any_cluster(capsys):
    """The layouts are the divisors of --gpus: 10^15 took 10 s here, 10^21 ran for ever."""
    err = refusal(capsys, ["plan", "--model", "tiny", "--gpu", "A100-80GB", "--seq", "256",
                           "--global-batch-tokens", "4096", "--gpus", str(10 ** 21)])
    assert f"--gpus {10 ** 21}: at most 10,000,000" in err


@pytest.mark.parametrize("env, name", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"), ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "-1"}, "LOCAL_WORLD_SIZE"),
    ({}, "WORLD_SIZE"),  # a launcher's run id without the world size
])
def test_train_under_a_launcher_refuses_a_broken_environment(capsys, monkeypatch, tmp_path, env,
                                                             name):
    """Under torchrun the counts come from the environment; int() of them was a traceback."""
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "hostile")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = refusal(capsys, ["train", "--dry-run", f"--train.run_dir={tmp_path / 'run'}"])
    assert f"environment {name}=" in err and "whole number >= 1" in err
    assert not (tmp_path / "run").exists()


_LAUNCHER_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


@pytest.mark.parametrize("env, name, rule", [
    ({"RANK": "2"}, "RANK", "in [0, 1] (WORLD_SIZE = 2)"),  # had waited 15 minutes for peers
    ({"RANK": "abc"}, "RANK", "in [0, 1]"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK", "in [0, 1] (LOCAL_WORLD_SIZE = 2)"),
    ({"TORCHELASTIC_RESTART_COUNT": "abc"}, "TORCHELASTIC_RESTART_COUNT", "in [0,"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT", "in [1, 65535]"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT", "in [1, 65535]"),
    ({"TORCHELASTIC_RUN_ID": "../.."}, "TORCHELASTIC_RUN_ID", "default run directory"),
    ({"TORCHELASTIC_RUN_ID": "a\nb"}, "TORCHELASTIC_RUN_ID", "default run directory"),
])
def test_train_under_a_launcher_refuses_ranks_ports_and_job_ids_it_cannot_use(
        capsys, monkeypatch, tmp_path, env, name, rule):
    """The ranks, restart count, port and job id a launcher sets: each refused by name before
    anything starts (they had been tracebacks, a 15-minute wait, or a run directory ``../..``).
    The job id names the run directory only when ``train.run_dir`` is unset."""
    monkeypatch.chdir(tmp_path)
    for key in _LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    launcher = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                "TORCHELASTIC_RUN_ID": "job7"}
    for key, value in {**launcher, **env}.items():
        monkeypatch.setenv(key, value)
    err = refusal(capsys, ["train", "--dry-run"])
    assert f"environment {name}=" in err and rule in err
    assert list(tmp_path.iterdir()) == []
    if name == "TORCHELASTIC_RUN_ID":  # with a run directory of its own, the id is not used
        assert cli.main(["train", "--dry-run", "--train.run_dir=runs/mine"]) == 0


LONG_NAME = "a" * 300  # one name past the kernel's 255 bytes: every call raises ENAMETOOLONG
LONG_PATH = "/".join(["abcdefgh"] * 600)  # 5,399 bytes, past PATH_MAX


@pytest.mark.parametrize("argv, named", [
    (["train", "--dry-run", f"--model.init_from={LONG_NAME}"], "model.init_from"),
    (["train", "--dry-run", f"--data.tokenizer={LONG_NAME}"], "data.tokenizer"),
    (["train", "--dry-run", f"--data.source={LONG_NAME}"], "data.source"),
    (["train", "--dry-run", f"--train.run_dir=runs/{LONG_PATH}"], "train.run_dir"),
    (["train", "--dry-run", f"--checkpoint.resume={LONG_NAME}"], "checkpoint.resume"),
    (["train", "--dry-run", f"--data.mix={LONG_NAME}:1,stdlib:1"], "data.mix"),
    (["train", "--dry-run", "--resume", LONG_NAME], "--resume"),
    (["data", "prepare", "--source", LONG_NAME, "--tokenizer", "byte", "--out", "o"], "--source"),
    (["data", "prepare", "--source", "stdlib", "--tokenizer", LONG_NAME, "--out", "o"],
     "--tokenizer"),
    (["data", "prepare", "--source", "stdlib", "--tokenizer", "byte", "--out", LONG_PATH],
     "--out"),
    (["plan", "--model", LONG_NAME, "--gpus", "8"], "--model"),
    (PLAN + ["--length-dist", LONG_NAME], "--length-dist"),
    (["hf", "import", "x", "--run", LONG_NAME], "--run"),
    (["schedule", "show", "1f1b", "--pp", "2", "-o", LONG_NAME + ".png"], "--output"),
])
def test_a_path_no_file_system_call_can_take_is_refused_by_name(capsys, monkeypatch, tmp_path,
                                                                argv, named):
    """A name over 255 bytes or a path over 4,095: ``Path.exists`` and ``is_file`` raise
    ENAMETOOLONG (they swallow only "not found"), which was a traceback in ten commands. Each
    path flag and path field is checked first (``loom.errors.path_error``); nothing is written."""
    monkeypatch.chdir(tmp_path)
    err = refusal(capsys, argv)
    assert named in err and ("not a usable path" in err or "no such file" in err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, field, rule", [
    # one past the devices this machine has (none on a CPU build): a worker had raised
    # AttributeError (no _cuda_setDevice) after the run directory was written
    (f"--train.device=cuda:{torch.cuda.device_count()}", "train.device", "needs CUDA device"),
    # train.device = auto, which is the CPU here (an explicit cpu was refused already)
    pytest.param("--train.backend=nccl", "train.backend", "cannot be nccl here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="auto is a GPU")),
])
def test_a_device_or_backend_this_machine_lacks_is_refused_before_the_launch(
        capsys, monkeypatch, tmp_path, override, field, rule):
    monkeypatch.chdir(tmp_path)
    err = refusal(capsys, ["train", "--train.steps=1", override])
    assert f"{field}=" in err and rule in err, err
    assert list(tmp_path.iterdir()) == []
