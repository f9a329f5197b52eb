"""`loom train --model.init_from=PATH` from the command line: bad paths refused before anything
is written; a good one trains, leaves PATH byte-identical, and exports back to transformers.

The refusals follow ``test_cli_input_refusals.py``'s contract (in process: exit 2, one line
naming the field and the rule, no traceback, the working directory untouched).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom.cli import EXIT_CONFIG_ERROR, main
from tests.e2e.test_cli_config_errors import assert_refused, clean_env, snapshot

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def _hf_model(path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)


def _setup(cwd: Path, case: str) -> None:
    model = cwd / "model"
    if case == "not-a-model":
        model.mkdir()
        (model / "notes.txt").write_text("no config here\n")
        return
    _hf_model(model)
    if case == "no-weights":
        (model / "model.safetensors").unlink()
    if case == "corrupt-weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:4096])  # cut short: offsets past the end
    if case in ("wider-weights", "narrower-weights", "quantized-weights"):
        from safetensors.torch import load_file, save_file

        weights = model / "model.safetensors"
        state = load_file(str(weights))
        name = "model.layers.0.self_attn.q_proj.weight"
        rows = {"wider-weights": 2 * SHAPE["hidden_size"],
                "narrower-weights": SHAPE["hidden_size"] // 2}.get(case)
        state[name] = (torch.zeros(rows, SHAPE["hidden_size"]) if rows
                       else state[name].to(torch.float8_e4m3fn))
        save_file(state, str(weights), metadata={"format": "pt"})
    if case == "unknown-rope":
        config = json.loads((model / "config.json").read_text())
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
        (model / "config.json").write_text(json.dumps(config))


SMALL = ("--data.seq_len=64", "--train.steps=1", "--data.tokenizer=byte",
         "--model.init_from=model")
CASES = {
    "missing": (("--model.init_from=nowhere",), ("model.init_from='nowhere'", "not a directory")),
    "not-a-model": ((), ("model.init_from='model'", "neither config.json")),
    "no-weights": ((), ("model.init_from='model'", "no model.safetensors")),
    "corrupt-weights": ((), ("model.init_from='model'", "not a readable safetensors file")),
    "unknown-rope": ((), ("model.init_from='model'", "rope_type")),
    # a larger tensor once trained on its corner; a smaller one failed in every worker
    "wider-weights": ((), ("model.init_from='model'", "q_proj.weight has shape (128, 64)",
                           "needs (64, 64)")),
    "narrower-weights": ((), ("model.init_from='model'", "has shape (32, 64)")),
    "quantized-weights": ((), ("model.init_from='model'", "stored as F8_E4M3")),
    "contradicting-override": (("--model.n_layers=3",),
                               ("model.n_layers=3", "contradicts model.init_from", "is 2")),
    "run-dir-inside": (("--train.run_dir=model/run",),
                       ("train.run_dir='model/run'", "inside model.init_from")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_pretrained_model_is_refused_before_anything_is_written(case, tmp_path, monkeypatch,
                                                                      capsys):
    argv, expected = CASES[case]
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, case)
    capsys.readouterr()
    before = snapshot(tmp_path)
    code = main(["train", *SMALL, *argv])
    out = capsys.readouterr()
    assert_refused(code, out, expected)
    assert snapshot(tmp_path) == before


def test_an_override_that_changes_no_weight_is_allowed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, "good")
    assert main(["train", *SMALL, "--model.max_seq_len=128", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "max_seq_len = 128" in printed and "n_layers = 2" in printed and "dim = 64" in printed


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_a_hf_model_directorys_tokenizer_is_the_default(tmp_path, monkeypatch, capsys):
    from tests.data_fixtures import make_tokenizer

    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, "good")
    make_tokenizer(tmp_path / "model", vocab_size=300)  # within the model's 320 rows
    argv = ["train", "--data.seq_len=64", "--train.steps=1", "--model.init_from=model"]
    assert main([*argv, "--print-config"]) == 0
    assert 'tokenizer = "model"' in capsys.readouterr().out
    assert main([*argv, "--data.tokenizer=byte", "--print-config"]) == 0  # an explicit one wins
    assert 'tokenizer = "byte"' in capsys.readouterr().out


def test_a_tokenizer_larger_than_the_pretrained_vocabulary_is_refused(tmp_path, monkeypatch,
                                                                      capsys):
    from tests.data_fixtures import make_tokenizer

    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, "good")
    make_tokenizer(tmp_path / "model", vocab_size=400)  # the model has 320 embedding rows
    capsys.readouterr()
    before = snapshot(tmp_path)
    assert main(["train", *SMALL[:2], "--model.init_from=model"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "model.vocab_size=320" in err and "Traceback" not in err, err
    assert snapshot(tmp_path) == before


def test_a_hf_fine_tune_under_tp_exports_the_same_logits_and_the_same_greedy_text(tmp_path):
    """Fine-tune from a HF directory with its tokenizer under tp = 2, export: transformers'
    logits on the exported weights are Loom's on the run's (and not the starting weights'), the
    pretrained directory is untouched, and for the same prompt Loom's `--temperature 0` text is
    transformers' greedy `generate`. (One fine-tune checked both ways: each costs a 2-rank
    launch.)"""
    from tests.data_fixtures import make_tokenizer

    _setup(tmp_path, "good")
    make_tokenizer(tmp_path / "model", vocab_size=300)
    env = clean_env()

    def loom(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "loom", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    before = _digest(tmp_path / "model")
    loom("train", "--nproc", "2", "--parallel.tp=2", "--model.init_from=model",
         "--data.seq_len=32", "--data.max_bytes=100000", "--train.steps=3",
         "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.eval_every=0",
         "--metrics.tensorboard=false", "--metrics.plot=false", "--train.run_dir=runs/ft")
    assert _digest(tmp_path / "model") == before  # the pretrained directory is untouched
    loom("hf", "export", "runs/ft", "out")

    from loom.generate import load_trained_model

    trained, _, _ = load_trained_model(tmp_path / "runs" / "ft", torch.device("cpu"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                 dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model",
                                                              dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, initial = trained(tokens), exported(tokens).logits, start(tokens).logits
    assert (got - want).abs().max() <= 1e-5
    assert (want - initial).abs().max() > 1e-4  # it trained: not the starting weights

    prompt = "def add(a, b):"
    ours = loom("generate", "--run", "runs/ft", "--prompt", prompt, "--temperature", "0",
                "--max-new-tokens", "12").stdout

    from loom.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tmp_path / "runs" / "ft" / "data")  # the run's own copy
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = exported.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=tokenizer.eos_id,
                      pad_token_id=tokenizer.eos_id)
    new = [t for t in out[0, ids.shape[1]:].tolist()]
    if tokenizer.eos_id in new:
        new = new[:new.index(tokenizer.eos_id)]
    assert new  # something was generated: the comparison is not of two empty strings
    assert ours.rstrip("\n") == prompt + tokenizer.decode(new)


@pytest.mark.parametrize("line, message", [
    ('dim = "wide"', "model.dim = 'wide' is not a int"),
    # TOML integers beyond any float or int64 (float() of the first overflowed)
    (f"norm_eps = {10 ** 400}", "model.norm_eps = 100000000000000000000000000000..."
                                "000000000000000000000000000000 is not a finite number"),
    (f"dim = {10 ** 30}", "is not a 64-bit integer"),
])
def test_a_loom_run_with_a_mistyped_shape_is_refused(tmp_path, monkeypatch, capsys, line,
                                                     message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(f"[model]\n{line}\n")
    before = snapshot(tmp_path)
    assert main(["train", "--model.init_from=run", "--data.tokenizer=byte"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "model.init_from='run'" in err and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and snapshot(tmp_path) == before
