"""Every ``loom`` command refuses a malformed flag as argparse sees it in one line naming the
flag, exit code 2 (``loom.errors.OneLineParser``), as it refuses a bad config value; and
``loom plan -o`` refuses a path it cannot write before it searches."""

from __future__ import annotations

import pytest

from loom import cli
from loom.plan.cli import main as plan_main

PLAN = ["plan", "--model", "tiny", "--gpus", "4", "--gpu", "A100-80GB", "--seq", "256",
        "--global-batch-tokens", "4096"]


@pytest.mark.parametrize("argv, flag", [
    (["train", "--nproc", "x"], "--nproc"),
    (["estimate-memory", "--nproc", "y"], "--nproc"),
    (["plan", "--gpus", "four"], "--gpus"),
    (["plan", "--global-batch-tokens", "1e30"], "--global-batch-tokens"),
    (["schedule", "search", "--pp", "4", "--memory-limit", "inf"], "--memory-limit"),
    (["hf", "import"], "HF_DIR"),
    (["no-such-command"], "no-such-command"),
])
def test_a_malformed_flag_is_one_line_naming_it(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and "usage:" not in err


@pytest.mark.parametrize("output, rule", [
    ("{tmp}", "is a folder"),
    ("{tmp}/a_file/plan.toml", "is not a writable folder"),
])
def test_plan_refuses_an_output_it_cannot_write_before_searching(capsys, tmp_path, output, rule):
    (tmp_path / "a_file").write_text("")
    path = output.format(tmp=tmp_path)
    assert plan_main([*PLAN, "-o", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the search printed anything
    assert captured.err.count("\n") == 1 and f"-o {path}: " in captured.err and rule in captured.err


def test_plan_writes_an_output_under_new_folders(capsys, tmp_path):
    path = tmp_path / "new" / "dir" / "plan.toml"
    assert plan_main([*PLAN, "-o", str(path)]) == 0
    assert path.read_text().startswith("# written by `loom plan`")


def test_plan_takes_a_config_file_whose_vocabulary_comes_from_its_tokenizer(capsys, tmp_path):
    """A config leaves ``model.vocab_size = 0`` to the tokenizer (configs/tiny.toml does): the
    planner fills it as ``resolve`` does (the tiny preset's byte tokenizer: 257 -> 320)."""
    config = tmp_path / "tiny.toml"
    config.write_text("[model]\npreset = 'tiny'\n")
    assert plan_main(["plan", "--model", str(config), "--gpus", "4", "--gpu", "A100-80GB",
                      "--global-batch-tokens", "4096", "--json"]) == 0
    assert '"ranked": [' in capsys.readouterr().out


@pytest.mark.parametrize("model, rule", [
    ("ffn_dim = 0", "model.ffn_dim=0: must be >= 1"),
    ("n_layers = 100000000", "model.n_layers=100000000: must be <= 100,000"),
])
def test_plan_refuses_a_config_file_whose_model_is_broken(capsys, tmp_path, model, rule):
    config = tmp_path / "broken.toml"
    config.write_text(f"[model]\npreset = 'tiny'\n{model}\n")
    assert plan_main(["plan", "--model", str(config), "--gpus", "4", "--gpu", "A100-80GB",
                      "--global-batch-tokens", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and rule in err
