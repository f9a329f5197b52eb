"""``loom plan --model`` reads a Hugging Face model directory (or its ``config.json``) as well as a
preset or a Loom config: the user plans the model they will train, as they have it. Only the
config is read (no weights, no torch); what Loom's model does not compute exactly is refused by
key, and the sequence length must be given (``max_position_embeddings`` is a limit).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loom.models.hf_config import hf_config_from_args
from loom.models.presets import PRESETS
from loom.plan.cli import main

CLUSTER = ["--gpus", "16", "--gpu", "H100-SXM", "--global-batch-tokens", "1048576"]


@pytest.fixture
def llama_dir(tmp_path):
    """Llama 3 8B as transformers writes it (llama3 RoPE scaling, GQA, 128k vocabulary)."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(PRESETS["llama3-8b"])))
    return tmp_path


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("seconds", None)
    out.pop("workload", None)
    return out


def test_an_hf_directory_plans_exactly_as_the_same_preset(capsys, llama_dir):
    from_preset = plan_json(capsys, "--model", "llama3-8b", "--seq", "8192", *CLUSTER)
    assert plan_json(capsys, "--model", str(llama_dir), "--seq", "8192", *CLUSTER) == from_preset
    assert plan_json(capsys, "--model", str(llama_dir / "config.json"), "--seq", "8192",
                     *CLUSTER) == from_preset


def test_the_written_config_trains_the_hf_shape(capsys, llama_dir, tmp_path):
    out = tmp_path / "planned.toml"
    assert main(["plan", "--model", str(llama_dir), "--seq", "8192", *CLUSTER, "-o",
                 str(out)]) == 0
    from loom.config import load_config, model_args
    assert model_args(load_config(out)) == PRESETS["llama3-8b"]


@pytest.mark.parametrize("change, message", [
    (None, "--seq: required with a Hugging Face config"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000: at most 100,000"),
    ({"rms_norm_eps": -1.0}, "model.norm_eps=-1.0"),
])
def test_what_the_planner_cannot_price_is_one_line_exit_2(capsys, llama_dir, change, message):
    argv = ["plan", "--model", str(llama_dir), *CLUSTER]
    if change is not None:
        path = llama_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
        argv += ["--seq", "8192"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_planning_from_an_hf_directory_imports_no_torch(llama_dir):
    code = ("import sys; from loom.plan.cli import main;"
            f" code = main(['plan', '--model', {str(llama_dir)!r}, '--seq', '8192',"
            f" *{CLUSTER!r}]);"
            " assert code == 0 and 'torch' not in sys.modules, (code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
