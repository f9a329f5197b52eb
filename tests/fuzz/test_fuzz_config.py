"""Fuzzing the configuration: random ``--section.key=value`` overrides of Loom's real fields.

* fast, in-process: ``load_config`` + ``resolve`` (+ the memory check ``loom train`` runs before
  writing) return a Config or raise ``ConfigError``, for string overrides (the command line) and
  for typed ones (what a TOML file's keys carry: lists, tables, dates, floats for ints ...);
* ``loom.cli.main(["train", ...])`` in a fresh workspace: exit 2 with one line and nothing
  written, or exit 0 having changed nothing outside the run directory (workers replaced by a stub:
  everything before the launch, token files included, runs for real);
* a handful of accepted small configs trained for real (one step, one process): exit 0.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from tests.fuzz import harness, strategies as S
from tests.fuzz.harness import check, fuzz_settings, workspace


def _fast_workspace():
    """One populated workspace, reused by the in-process config checks (they write nothing)."""
    def make():
        root = harness.session_dir() / "config-ws"
        root.mkdir()
        harness.populate(root)
        return root
    return harness.once("config-ws", make)


@fuzz_settings("config_fast")
@given(S.overrides())
def test_load_and_resolve_raise_only_config_error(drawn):
    overrides, world = drawn
    root = _fast_workspace()
    before = harness.snapshot(root)
    with harness.chdir(root):
        outcome = harness.config_fast(overrides, world)
    if outcome.kind != "other" and harness.changed_paths(before, harness.snapshot(root)):
        outcome = harness.Outcome("other", "load_config/resolve changed files")
    check("config-fast", outcome, (overrides, world))


@fuzz_settings("config_fast_typed")
@given(S.typed_overrides())
def test_typed_values_raise_only_config_error(drawn):
    overrides, world = drawn
    with harness.chdir(_fast_workspace()):
        check("config-typed", harness.config_fast(overrides, world), (overrides, world))


def cheap_data(overrides: dict[str, str]) -> dict[str, str]:
    """Keep an accepted config's token files small: the whole standard library takes seconds
    to tokenize (minutes for BPE), a few hundred kB takes milliseconds. Changes no refusal."""
    out = dict(overrides)
    if out.get("data.source", "stdlib") == "stdlib":
        try:
            max_bytes = int(out.get("data.max_bytes", "0"))
        except ValueError:
            return out
        if max_bytes == 0 or max_bytes > 200_000:
            out["data.max_bytes"] = "100000"
    return out


def as_argv(overrides: dict[str, str], nproc: int) -> list[str]:
    return ["--nproc", str(nproc), *(f"--{k}={v}" for k, v in overrides.items())]


CLI_FLAGS = [["--resume", "auto"], ["--resume", "auto_or_fresh"], ["--resume", "ckpt"],
             ["--resume", "ckpt_deep"], ["--resume", "ckpt_fifo"], ["--resume", "missing"],
             ["--resume", ""], ["--max-restarts", "-1"], ["--max-restarts", "2"]]


@fuzz_settings("config_cli")
@given(S.overrides(exclude=("data.max_bytes",)), st.sampled_from(["run", "", "out/run"]),
       st.lists(st.sampled_from(CLI_FLAGS), max_size=2))
def test_cli_train_exits_0_or_2_and_refusals_write_nothing(drawn, run_dir, flags):
    overrides, world = drawn
    overrides = harness.contain_paths(cheap_data(overrides))
    overrides.setdefault("train.run_dir", run_dir)
    argv = [arg for flag in flags for arg in flag] + as_argv(overrides, world)
    with workspace() as root:
        harness.populate(root)
        check("config-cli", harness.run_cli(argv, root), argv)


# ---------------------------------------------------------------------------------------------
# Accepted configs, trained for real (expensive: a worker process each)


@st.composite
def small_trainable(draw):
    micro = draw(st.sampled_from([1, 2]))
    out = {
        "model.preset": draw(st.sampled_from(["debug", "tiny-moe"])),
        "model.n_layers": str(draw(st.integers(2, 4))),
        "model.tie_embeddings": draw(st.sampled_from(["false", "true"])),
        "data.source": draw(st.sampled_from(["corpus.txt", "corpus"])),
        "data.tokenizer": draw(st.sampled_from(["byte", "byte", "bpe"])),
        "data.bpe_vocab_size": str(draw(st.integers(260, 400))),
        "data.seq_len": str(draw(st.sampled_from([8, 16, 32]))),
        "data.val_fraction": repr(draw(st.floats(0.05, 0.5))),
        "train.steps": "1",
        "train.micro_batch_size": str(micro),
        "train.global_batch_size": str(micro * draw(st.sampled_from([1, 2]))),
        "train.dtype": draw(st.sampled_from(["fp32", "bf16"])),
        "train.recompute": draw(st.sampled_from(["none", "full", "selective", "every_k"])),
        "train.grad_clip": repr(draw(st.sampled_from([0.0, 1.0, 0.5]))),
        "train.nonfinite": draw(st.sampled_from(["stop", "skip"])),
        "train.eval_every": draw(st.sampled_from(["0", "1"])),
        "train.eval_batches": "1",
        "train.threads": "1",
        "train.seed": str(draw(st.integers(0, 2**31))),
        "optim.lr": repr(draw(st.floats(1e-5, 1e-1))),
        "optim.warmup_steps": str(draw(st.integers(0, 3))),
        "optim.weight_decay": repr(draw(st.floats(0, 0.5))),
        "checkpoint.interval": draw(st.sampled_from(["0", "1"])),
        "metrics.tensorboard": draw(st.sampled_from(["false", "true"])),
        "metrics.plot": draw(st.sampled_from(["false", "true"])),
        "metrics.progress": "false",
        "metrics.comm": draw(st.sampled_from(["false", "true"])),
        "train.run_dir": draw(st.sampled_from(["run", "runs/ünï", "a/b/run"])),
    }
    return out


@pytest.mark.timeout(900)
@settings(fuzz_settings("config_train"), phases=[Phase.explicit, Phase.generate])  # no shrinking:
@given(small_trainable())                                                 # a run is seconds
def test_accepted_small_configs_train_and_exit_0(overrides):
    with workspace() as root:
        harness.populate(root)
        with harness.chdir(root):
            accepted = harness.config_fast(overrides, 1)
        assume(accepted.kind == "ok")  # a refusal is the other tests' business
        argv = as_argv(overrides, 1)
        outcome = harness.run_cli(argv, root, launch=True)
        run_dir = root / overrides["train.run_dir"]
        if outcome.kind == "ok" and not (run_dir / "config.toml").is_file():
            outcome = harness.Outcome("other", "exit 0 without a run directory")
        if outcome.kind == "refused":
            outcome = harness.Outcome("other", f"accepted by resolve, refused by loom train:"
                                               f" {outcome.detail}")
        check("config-train", outcome, argv)
