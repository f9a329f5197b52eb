"""The bugs the fuzz suite found, one exact reproduction each, now regression tests (each failed
before its fix): a world size of 0, a preset that is not a string, a key with a line break, a
FIFO in place of a manifest, a MoE model in bf16 on CPU, absurdly deep JSON, an RNG state of
another size. A new finding goes into ``harness.KNOWN_BUGS`` with an ``xfail(strict=False)``
case here until it is fixed (the fuzz tests tolerate listed bugs so that they keep looking for
new ones; ``LOOM_FUZZ_STRICT=1`` tolerates none)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from contextlib import redirect_stderr

import pytest

from tests.fuzz import harness
from tests.fuzz.harness import workspace


def test_resolve_with_world_size_0_raises_config_error():
    from loom.config import ConfigError, load_config, resolve

    with pytest.raises(ConfigError):
        resolve(load_config(None, {"model.preset": "debug"}), 0)


@pytest.mark.parametrize("toml", ['[model]\npreset = ["tiny"]\n', "[model]\npreset = {a = 1}\n"])
def test_a_preset_that_is_not_a_string_is_refused_with_exit_2(toml):
    with workspace() as root:
        (root / "c.toml").write_text(toml)
        outcome = harness.run_cli(["--config", "c.toml"], root)
    assert outcome.kind == "refused", outcome.detail + "\n" + outcome.trace


def test_a_refusal_naming_a_key_with_a_line_break_is_one_line():
    from loom.cli import main

    err = io.StringIO()
    with workspace(), redirect_stderr(err):
        assert main(["train", "--train.a\nb=1"]) == 2
    assert err.getvalue().count("\n") == 1, repr(err.getvalue())


@contextlib.contextmanager
def _plain_checkpoints():
    """A copy of the session's two-step checkpoint folder: (checkpoint module, workspace, root,
    newest step)."""
    from tests.fuzz import ckpt_mutations as M

    with workspace() as ws, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = ws / "ckpts"
        shutil.copytree(M.base_checkpoints()["plain"], root)
        yield M.ckpt_module(), ws, root, sorted(root.iterdir())[-1]


def test_a_fifo_in_place_of_the_manifest_is_refused_without_blocking():
    with _plain_checkpoints() as (ck, ws, root, step):
        (step / "manifest.json").unlink()
        os.mkfifo(step / "manifest.json")
        finished, _, error = harness.call_with_timeout(
            lambda: ck.verify(step), 5, lambda: harness.unblock_fifos(ws))
    assert finished, "verify blocked on the FIFO"
    assert isinstance(error, ck.CheckpointError)


@pytest.mark.timeout(300)
def test_a_moe_model_trains_a_step_in_bf16_on_cpu():
    argv = ["--model.preset=tiny-moe", "--train.dtype=bf16", "--train.steps=1",
            "--data.source=corpus.txt", "--data.seq_len=16", "--train.global_batch_size=1",
            "--train.micro_batch_size=1", "--train.run_dir=run", "--metrics.progress=false",
            "--train.eval_every=0"]
    with workspace() as root:
        harness.populate(root)
        outcome = harness.run_cli(argv, root, launch=True)
    assert outcome.kind == "ok", outcome.detail


def test_deeply_nested_json_manifest_is_refused():
    with _plain_checkpoints() as (ck, ws, root, step):
        (step / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(ck.CheckpointError):
            ck.verify(step)
        assert ck.latest_loadable(root)[0] is not None  # falls back to step 1
        harness.populate(ws)
        outcome = harness.run_cli(["--resume", str(step), "--data.source=corpus.txt"], ws)
    assert outcome.kind == "refused", outcome.detail


def test_an_rng_state_of_another_size_is_refused_by_load():
    import torch

    with _plain_checkpoints() as (ck, ws, root, step):
        from tests.fuzz import ckpt_mutations as M

        state = {"cpu": torch.zeros(3, dtype=torch.uint8)}
        (step / "rng" / "rank0.pt").write_bytes(M.torch_bytes(state))
        M.forge(step)  # consistent: as if saved by a torch whose generator state differs
        with pytest.raises(ck.CheckpointError):
            ck.load(step, M.template())
