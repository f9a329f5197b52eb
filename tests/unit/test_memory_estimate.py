"""The memory estimator against hand-derived numbers, and the launch refusal."""

from __future__ import annotations

import pytest

from loom.cli import main
from loom.config import load_config, resolve
from loom.train.memory import check_memory_limit, estimate_memory, layer_activation_bytes

# debug preset, byte tokenizer (vocab 257 -> 320): one layer = wq 4096 + wk 2048 + wv 2048 +
# wo 4096 + norms 128 + SwiGLU 3*64*128 = 36,992; 4 layers + embedding 20,480 + head 20,480 +
# final norm 64 = 188,992 parameters.
PSI = 188_992
SMALL = {"model.preset": "debug", "data.seq_len": "32", "train.micro_batch_size": "2",
         "train.global_batch_size": "8"}


def config(world: int, **overrides):
    return resolve(load_config(None, {**SMALL, **overrides}), world)


@pytest.mark.parametrize("stage, params, grads, optim", [
    (0, 4 * PSI, 4 * PSI, 8 * PSI),
    (1, 4 * PSI, 4 * PSI, 8 * PSI / 4),
    (2, 4 * PSI, 4 * PSI / 4, 8 * PSI / 4),
    (3, 4 * PSI / 4, 4 * PSI / 4, 8 * PSI / 4),
])
def test_model_state_per_zero_stage(stage, params, grads, optim):
    over = {"parallel.dp_shard": "4", "parallel.zero_stage": str(stage)} if stage else {}
    est = estimate_memory(config(4, **over))
    assert (est.parameters, est.gradients, est.optimizer) == (params, grads, optim)
    assert est.model_state == params + grads + optim


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_over_dp_shard_times_cp(stage):
    """cp ranks hold the same weights, so ZeRO shards over dp_shard x cp: dp_shard 2 x cp 2 is
    dp_shard 4's model state (measured to the byte: docs/benchmarks.md, ZeRO compositions)."""
    over = {"parallel.zero_stage": str(stage)}
    with_cp = estimate_memory(config(4, **over, **{"parallel.dp_shard": "2", "parallel.cp": "2",
                                                   "parallel.cp_mode": "ring"}))
    assert with_cp.model_state == estimate_memory(config(4, **over, **{
        "parallel.dp_shard": "4"})).model_state


def test_zero3_transient_is_two_gathered_blocks():
    assert estimate_memory(config(2, **{"parallel.dp_shard": "2"})).transient == 2 * 4 * 36_992


def test_layer_activations_match_the_measured_formula():
    # s=32, b=2, h=64, f=128, a=4, fp32: x = 4096; x*e*(10 + 4f/h) + 4sb(2 + a)
    assert layer_activation_bytes(config(1)) == 4096 * 4 * 18 + 4 * 64 * 6
    # TP=2: x*e*(6 + (4 + 4f/h)/t) + 4sb(2 + a/t)
    tp = config(2, **{"parallel.tp": "2", "model.n_kv_heads": "4"})
    assert layer_activation_bytes(tp) == 4096 * 4 * (6 + 12 / 2) + 4 * 64 * (2 + 2)
    # full recomputation keeps the block input only
    assert layer_activation_bytes(config(1), layer_recomputed=True) == 4096 * 4


def test_recomputation_shrinks_activations_in_order():
    acts = {p: estimate_memory(config(1, **{"train.recompute": p})).activations
            for p in ("none", "selective", "every_k", "full")}
    assert acts["none"] > acts["selective"] > acts["every_k"] > acts["full"]


def test_pipeline_in_flight_microbatches():
    # 1F1B, pp=2, 4 microbatches: rank 0 holds 2 in flight of its 2 layers + embedding
    est = estimate_memory(config(2, **{"parallel.pp": "2", "train.global_batch_size": "8"}))
    assert est.rank in (0, 1)
    assert est.activations >= 2 * 2 * layer_activation_bytes(config(1))


def test_refusal_names_estimate_and_largest_component():
    tight = config(1, **{"train.memory_limit_gb": "0.0001"})
    message = check_memory_limit(tight)
    assert "exceeds the limit" in message and "largest component: optimizer" in message
    assert check_memory_limit(config(1, **{"train.memory_limit_gb": "0.0001",
                                           "train.ignore_memory_limit": "true"})) is None
    assert check_memory_limit(config(1)) is None  # CPU, no limit: no check


def test_loom_train_refuses_before_launch(capsys, tmp_path):
    code = main(["train", "--model.preset=debug", "--train.memory_limit_gb=0.0001",
                 f"--train.run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "estimated peak memory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_estimate_memory_command(capsys):
    assert main(["estimate-memory", "--nproc", "4", "--parallel.dp_shard=4",
                 "--model.preset=debug"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "total" in out
