"""The post-validated optimizer step is the synchronous step, bit for bit, and one process's.

``train.post_validation = true`` steps AdamW before the global gradient norm and loss arrive and
rolls back when they say the step had to be clipped or was non-finite
(``loom/train/post_validation.py``). For pp2 (1F1B and ZB-V), pp2 x dp2, dp2, tp2 (with and
without a pipeline, SP on), an MoE model's ep2 (with and without a pipeline, and ep2 x tp2) and
FSDP2 (ZeRO-3 on dp_shard 2, with and without a pipeline),
five steps with a clip limit that the gradient norm crosses on some steps and not on others
must give exactly
the synchronous path's losses, norms, gradients, parameters after every step and optimizer state
(compared as bytes), roll back exactly on the clipped steps, and match one process within the
parity tolerances. A NaN gradient on one stage with ``train.nonfinite = skip`` must leave every
rank's weights as they were, including the ranks that stepped optimistically on finite
gradients; with ``stop`` every rank stops naming the step, weights restored.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch

from loom.parallel.expert import expert_parameter_names
from loom.testing.parity import assert_parity, layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

STEPS = 5
CLIP = 2.75  # one process's norms (debug preset, this data): ~2.66, 3.3, 2.65, 2.8, 2.4
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 1, "optim.warmup_steps": 2,
        "optim.lr": 1e-3, "train.grad_clip": CLIP}
POISONED = "layers.0.attention.wq.weight"  # on pipeline stage 0 only
# Against one process: tests/dist/test_pipeline_parity.py's tolerances and reasons (step 1:
# summation order only; later steps: Adam amplifies rounding-level differences).
RTOL_FIRST, ATOL_FIRST, RTOL, ATOL = 1e-5, 1e-6, 1e-4, 1e-5
# tp sums each shard's partial products in another order: AdamW's first step moves a weight by
# lr * g / (|g| + eps), so where |g| is near eps a rounding-level difference in g moves it by a
# visible part of lr (measured, tp2 and pp2 x tp2: one of wo's 4,096 weights, 1.47e-5 at lr
# 1e-3, the same over five steps; every other weight within 1e-5)
PARAMS_ATOL_TP = 3e-5


def _gather_by_name(tensors: dict[str, torch.Tensor],
                    own: Callable[[str], str] = lambda name: name) -> dict[str, torch.Tensor]:
    """Every rank's named tensors merged over the world; replicas (dp) must be bit-identical.
    A tp shard (DTensor) is gathered whole first (every rank holds the same names in the same
    order); ``own`` renames what a rank holds alone (an ep rank's experts)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    whole = {own(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
             for k, v in tensors.items()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, whole)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            if name in merged:
                assert _same_bits(merged[name], value), f"replicas of {name} differ"
            merged[name] = value
    return merged


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))


def record(ctx, config_table: dict, data_dir: str, steps: int, poison_step: int = 0) -> dict:
    """Per step: loss, norm, named gradients and parameters (gathered); at the end the
    optimizer state by name and the rollback count. ``poison_step``: the step whose gradient of
    ``POISONED`` becomes NaN (0: none). A stop is returned, not raised."""
    from loom.config import from_dict
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    params = dict(trainer.model.named_parameters())
    experts = expert_parameter_names(trainer.model) if trainer.ep is not None else set()
    ep_rank = trainer.grid.coords(ctx.rank)["ep"]

    def own(name: str) -> str:  # "layers.1.feed_forward.experts.w1.exp_avg" -> "...@ep1"
        return f"{name}@ep{ep_rank}" if any(name.startswith(e) for e in experts) else name

    if poison_step and POISONED in params:
        params[POISONED].register_hook(
            lambda g: g * math.nan if trainer.step + 1 == poison_step else g)
    rec: dict = {"loss": [], "grad_norm": [], "grads": [], "params": [], "skipped": []}
    before = _gather_by_name(params, own)
    for _ in range(steps):
        try:
            metrics = trainer.train_step()
        except FloatingPointError as err:
            rec["stopped"] = str(err)
            rec["restored"] = all(_same_bits(before[k], v)
                                  for k, v in _gather_by_name(params, own).items())
            return rec
        rec["loss"].append(metrics["loss"])
        rec["grad_norm"].append(metrics["grad_norm"])
        rec["skipped"].append(metrics.get("skipped_steps", 0))
        rec["grads"].append({k: v.cpu() for k, v in trainer.named_gradients().items()})
        before = _gather_by_name(params, own)
        rec["params"].append(before)
    state = {f"{name}.{key}": value for name, p in params.items()
             for key, value in trainer.optimizer.state[p].items()}
    rec["optimizer"] = _gather_by_name(state, own)
    rec["rollbacks"] = getattr(trainer.optimizer_step, "rollbacks", None)
    return rec


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_bit_identical(sync: dict, post: dict, label: str) -> None:
    """Everything recorded equal as bytes (NaN included)."""
    assert len(post["loss"]) == len(sync["loss"]) == STEPS, label
    for step in range(STEPS):
        where = f"{label} step {step + 1}"
        assert _float_bits(post["loss"][step]) == _float_bits(sync["loss"][step]), where
        assert _float_bits(post["grad_norm"][step]) == _float_bits(sync["grad_norm"][step]), where
        assert post["skipped"][step] == sync["skipped"][step], where
        for kind in ("grads", "params"):
            got, ref = post[kind][step], sync[kind][step]
            assert set(got) == set(ref), f"{where}: {kind} names differ"
            for name in ref:
                assert _same_bits(got[name], ref[name]), f"{where}: {kind} of {name} differ"
    assert set(post["optimizer"]) == set(sync["optimizer"]), label
    for name, ref in sync["optimizer"].items():
        assert _same_bits(post["optimizer"][name], ref), f"{label}: optimizer state {name}"


def assert_matches_one_process(reference: dict, result: dict, label: str,
                               params_atol: float = ATOL) -> None:
    finite = [s for s in range(STEPS) if math.isfinite(reference["grad_norm"][s])]
    assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                  steps=range(1))
    assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label, steps=finite)
    for step in range(STEPS):
        assert math.isfinite(result["grad_norm"][step]) == (step in finite), f"{label} {step}"
        params = result["params"][step]
        for name, value in reference["params"][step].items():
            got = params.get(name)
            if got is None:  # experts: each ep rank's block of them, in ep order
                parts = sorted(k for k in params if k.startswith(f"{name}@ep"))
                assert parts, f"{label}: no {name}"
                got = torch.cat([params[k] for k in parts])
            torch.testing.assert_close(got, value, rtol=RTOL, atol=params_atol,
                                       msg=lambda m, n=name: f"{label} step {step + 1} {n}: {m}")


@pytest.fixture(scope="module")
def one_process(dist, small_data_dir):
    """The one-process synchronous runs, by poisoned step, computed on first use."""
    cache: dict[tuple[int, str], dict] = {}

    def get(poison_step: int, model: str = "dense") -> dict:
        if (poison_step, model) not in cache:
            config = layout_config({**BASE, **MODELS[model], "train.nonfinite": "skip"}, 1)
            cache[poison_step, model] = dist.run(1, record, config, small_data_dir, STEPS,
                                                 poison_step)[0]
        return cache[poison_step, model]

    return get


LAYOUTS = {"pp2-1f1b": {"pp": 2}, "pp2-zbv": {"pp": 2, "schedule": "zbv"},
           "pp2xdp2-1f1b": {"pp": 2, "dp_replicate": 2},
           "pp2xdp2-zbv": {"pp": 2, "dp_replicate": 2, "schedule": "zbv"},
           "dp2": {"dp_replicate": 2},
           # tp: the norm's squares summed over tp first (blocking), then over pp behind the step
           "tp2": {"tp": 2, "dp_replicate": 1, "sequence_parallel": True},
           "pp2xtp2-1f1b": {"pp": 2, "tp": 2, "dp_replicate": 1, "sequence_parallel": True},
           # an MoE model: the experts' squares summed over ep first (and over tp, expert-TP)
           "ep2": {"ep": 2, "dp_replicate": 1, "model": "moe"},
           "pp2xep2-1f1b": {"pp": 2, "ep": 2, "dp_replicate": 1, "model": "moe"},
           "ep2xtp2": {"ep": 2, "tp": 2, "dp_replicate": 1, "model": "moe"},
           # FSDP2 (ZeRO-3): DTensor shards, squares over the shard mesh first, then over pp
           "zero3": {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3},
           "pp2xzero3-1f1b": {"pp": 2, "dp_shard": 2, "dp_replicate": 1, "zero_stage": 3}}
MODELS = {"dense": {}, "moe": {"model.n_experts": 4, "model.top_k": 2,
                               "model.expert_ffn_dim": 64, "model.n_dense_layers": 1}}


def _run(dist, data_dir: str, layout: str, *, post: bool, poison_step: int = 0,
         nonfinite: str = "skip", dtype: str = "fp32") -> list[dict]:
    degrees = dict(LAYOUTS[layout])
    schedule = degrees.pop("schedule", "1f1b")
    model = MODELS[degrees.pop("model", "dense")]
    world = math.prod(v for k, v in degrees.items()
                      if not isinstance(v, bool) and k != "zero_stage")
    config = layout_config({**BASE, **model, "parallel.schedule": schedule,
                            "train.nonfinite": nonfinite, "train.post_validation": post,
                            "train.dtype": dtype}, world, **degrees)
    return dist.run(world, record, config, data_dir, STEPS, poison_step)


# CI: pp2 1F1B, pp2 x dp2 ZB-V (ZB-V's split backwards), dp2, pp2 x ep2 and pp2 x ZeRO-3 (the
# rollbacks with the norm's squares first summed over ep or FSDP2's mesh, the latter's of
# DTensor shards); the others, pp2 x tp2 among them, in the matrix
@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=["pp2-1f1b", "pp2xdp2-zbv", "dp2",
                                                       "pp2xep2-1f1b", "pp2xzero3-1f1b"]))
def test_post_validation_equals_the_synchronous_step_bit_for_bit(dist, small_data_dir,
                                                                 one_process, layout):
    sync = _run(dist, small_data_dir, layout, post=False)
    post = _run(dist, small_data_dir, layout, post=True)
    norms = sync[0]["grad_norm"]
    clipped = [n > CLIP * (1 + 1e-3) for n in norms]
    # The case is meaningful only if the limit is crossed on some steps and not on others, and
    # not so narrowly that rounding could decide it.
    assert any(clipped) and not all(clipped), norms
    assert all(abs(n - CLIP) > 1e-3 * CLIP for n in norms), norms
    reference = one_process(0, LAYOUTS[layout].get("model", "dense"))
    for rank, (s, p) in enumerate(zip(sync, post)):
        label = f"{layout} rank {rank}"
        assert_bit_identical(s, p, label)
        # Roll back exactly where clipping is needed; without a pipeline the norm is local and
        # clipping happens before the step, so nothing is ever rolled back.
        assert p["rollbacks"] == (sum(clipped) if "pp" in LAYOUTS[layout] else 0), label
        assert_matches_one_process(reference, p, label,
                                   PARAMS_ATOL_TP if "tp" in LAYOUTS[layout] else ATOL)


# CI: a pipeline (its rollback runs on every stage); pp2 x dp2 ZB-V and plain dp (whose step
# with a local norm CI runs in the bit-for-bit test above) in the matrix
# (Not FSDP2: it writes the reduced gradient into the sharded parameter without autograd, so
# the poisoning hook never fires there; its rollback is the clipping one, tested above.)
@pytest.mark.parametrize("layout", matrix(["pp2-1f1b", "pp2xdp2-zbv", "dp2", "pp2xtp2-1f1b",
                                           "pp2xep2-1f1b"], ci=["pp2-1f1b"]))
def test_a_non_finite_step_is_skipped_as_the_synchronous_step_skips_it(dist, small_data_dir,
                                                                       one_process, layout):
    sync = _run(dist, small_data_dir, layout, post=False, poison_step=2)
    post = _run(dist, small_data_dir, layout, post=True, poison_step=2)
    reference = one_process(2, LAYOUTS[layout].get("model", "dense"))
    assert math.isnan(reference["grad_norm"][1]) and reference["skipped"][1:] == [1] * 4
    for rank, (s, p) in enumerate(zip(sync, post)):
        label = f"{layout} rank {rank}"
        assert_bit_identical(s, p, label)
        # Every rank stepped optimistically (finite gradients on the ranks without the poisoned
        # weight) and rolled back: the weights after the skipped step are the step-1 weights.
        assert p["grads"][1] == {} and p["rollbacks"] >= 1, label
        for name, value in p["params"][0].items():
            assert _same_bits(p["params"][1][name], value), f"{label}: {name} moved"
        assert_matches_one_process(reference, p, label,
                                   PARAMS_ATOL_TP if "tp" in LAYOUTS[layout] else ATOL)


def test_stop_restores_the_weights_and_names_the_step(dist, small_data_dir):
    for result in _run(dist, small_data_dir, "pp2-1f1b", post=True, poison_step=2,
                       nonfinite="stop"):
        assert "at step 2" in result["stopped"] and "train.nonfinite=stop" in result["stopped"]
        assert result["restored"] and len(result["loss"]) == 1


# bf16 parameters: the step (synchronous or post-validated) runs inside ``master_window``, so the
# rollback copies and restores the fp32 masters and their AdamW state; the bf16 parameters take
# the masters' rounding after it. CI: the pipeline, which rolls back where clipping is needed.
@pytest.mark.parametrize("layout", matrix(["pp2-1f1b", "dp2"], ci=["pp2-1f1b"]))
def test_bf16_post_validation_equals_the_synchronous_bf16_step_bit_for_bit(dist, small_data_dir,
                                                                           layout):
    sync = _run(dist, small_data_dir, layout, post=False, dtype="bf16")
    post = _run(dist, small_data_dir, layout, post=True, dtype="bf16")
    norms = sync[0]["grad_norm"]
    clipped = [n > CLIP * (1 + 1e-3) for n in norms]
    assert any(clipped) and not all(clipped), norms
    for rank, (s, p) in enumerate(zip(sync, post)):
        label = f"bf16 {layout} rank {rank}"
        assert_bit_identical(s, p, label)
        assert all(v.dtype == torch.bfloat16 for v in p["params"][-1].values()), label
        assert p["rollbacks"] == (sum(clipped) if "pp" in LAYOUTS[layout] else 0), label


@pytest.mark.matrix  # CI runs the clipping rollbacks above (the same restore of the masters)
def test_a_bf16_non_finite_step_is_skipped_and_the_masters_restored(dist, small_data_dir):
    sync = _run(dist, small_data_dir, "pp2-1f1b", post=False, poison_step=2, dtype="bf16")
    post = _run(dist, small_data_dir, "pp2-1f1b", post=True, poison_step=2, dtype="bf16")
    for rank, (s, p) in enumerate(zip(sync, post)):
        label = f"bf16 pp2-1f1b rank {rank}"
        assert_bit_identical(s, p, label)
        assert p["skipped"][1] == 1 and p["rollbacks"] >= 1, label
        for name, value in p["params"][0].items():
            assert _same_bits(p["params"][1][name], value), f"{label}: {name} moved"
