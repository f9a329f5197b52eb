"""Gradient compression in the data-parallel reducer at dp = 2 (``loom.parallel.compression``).

The reducer is driven with known gradients: a model whose loss is ``sum(p * G_p)`` has gradient
``G_p`` exactly, seeded per rank and step. Checked: ``none`` is today's fp32 all-reduce bit for
bit; int8, top-k and PowerSGD keep error feedback's identity (everything sent plus the residuals
left is the sum of every true gradient) and give every rank the same average; PowerSGD at full
rank is the uncompressed average; the ledger holds the compressed payloads; the trainer learns
with each mode, and a resumed run continues bit-exactly with the saved residuals.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loom.config import from_dict
from loom.layout import CompressionSpec
from loom.parallel.comm import CommLedger
from loom.parallel.compression import Int8Compressor
from loom.parallel.data import GradientReducer
from loom.parallel.expert import expert_parameter_names
from loom.parallel.mixed_precision import apply_bf16_parameters, clear_main_grads, gradient_of
from loom.testing.parity import layout_config
from loom.train.trainer import Trainer
from tests.conftest import SMALL_DATA_OVERRIDES

WORLD = 2
SHAPES = {"embed": (50, 16), "w1": (16, 40), "bias": (40,), "w2": (40, 24), "scale": (24,),
          "conv": (6, 4, 3)}
BUCKET_BYTES = 4 * 1200  # a few buckets, each holding one or more tensors


class _Known(nn.Module):
    """Parameters of the shapes above; ``loss(grads)`` has exactly ``grads`` as gradient."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterDict({name: nn.Parameter(torch.randn(*shape,
                                                                        generator=generator))
                                         for name, shape in SHAPES.items()})

    def loss(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((param * grads[name]).sum() for name, param in self.weights.items())


def _gradients(rank: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    # a low-rank part plus noise, like real gradients, over a few decades of magnitude
    out = {}
    for name, shape in SHAPES.items():
        value = torch.randn(*shape, generator=generator)
        if len(shape) >= 2:
            left = torch.randn(shape[0], 1, generator=generator)
            # the embedding's gradient exactly rank 1: L-GreCo can lower its rank for free
            noise = 0.0 if name == "embed" else 0.1
            value = noise * value + 3 * (left @ torch.randn(1, math.prod(shape[1:]),
                                                             generator=generator)).view(shape)
        out[name] = value
    return out


def reduce_known(ctx, spec: dict | None, steps: int, *, bf16: bool = False,
                 rounded: bool = False) -> dict:
    """Feed ``steps`` steps of known gradients through a reducer; record what it returns.
    ``bf16``: bf16 parameters with fp32 masters and fp32 ``main_grad`` (``train.dtype = bf16``),
    whose backward delivers the gradients rounded to bf16; ``rounded``: fp32 parameters fed
    those same rounded gradients."""
    model = _Known()
    if bf16:  # before the reducer: the fold into main_grad runs before its hooks
        apply_bf16_parameters(model, torch.float32)
    ledger = CommLedger()
    compression = CompressionSpec(**spec) if spec is not None else None
    # buckets are sized by the parameters' bytes: half of them hold the same bf16 parameters
    reducer = GradientReducer(list(model.parameters()), dist.group.WORLD, ctx.world_size,
                              ledger=ledger, bucket_bytes=BUCKET_BYTES // (2 if bf16 else 1),
                              compression=compression,
                              seed=7)
    names = {id(p): n for n, p in model.weights.items()}
    record = {"reduced": [], "ledger": [], "buckets": [[names[id(p)] for p in bucket]
                                                      for bucket in reducer.buckets]}
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        clear_main_grads(list(model.parameters()))  # the trainer's zero_grad of main_grad
        grads = _gradients(ctx.rank, step)
        if rounded:
            grads = {n: g.to(torch.bfloat16).float() for n, g in grads.items()}
        model.loss(grads).backward()
        reducer.finish()
        record["reduced"].append({n: gradient_of(p).clone() for n, p in model.weights.items()})
        record["ledger"].append({key: (r.calls, r.payload_bytes)
                                 for key, r in ledger.records.items()})
        ledger.reset()
    compressor = reducer.compressor
    record["compressor"] = compressor is not None
    if compressor is not None:
        record["residual"] = {names[id(p)]: r.clone()
                              for p, r in zip(compressor.params, compressor.residual)}
        record["levels"] = {names[id(p)]: int(level)
                            for p, level in zip(compressor.params, compressor.level)}
    return record


def _true_sum(steps: int) -> dict[str, torch.Tensor]:
    total = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    for step in range(steps):
        for rank in range(WORLD):
            for name, grad in _gradients(rank, step).items():
                total[name] += grad
    return total


def test_none_is_todays_all_reduce_bit_for_bit(dist):
    """``none`` (as the config resolves it, no compressor) reduces every bucket as before: each
    rank's gradient divided by 2, summed (at two ranks the sum's order cannot matter)."""
    results = dist.run(WORLD, reduce_known, {"method": "none"}, 2)
    for result in results:
        assert not result["compressor"]
        for step in range(2):
            sent = [_gradients(rank, step) for rank in range(WORLD)]
            for name in SHAPES:
                expected = sent[0][name] / WORLD + sent[1][name] / WORLD
                assert torch.equal(result["reduced"][step][name], expected), name
            assert set(result["ledger"][step]) == {("dp", "all_reduce")}


SPECS = {
    "int8": {"method": "int8"},
    "topk": {"method": "topk", "topk_ratio": 0.05},
    "powersgd": {"method": "powersgd", "rank": 2},
    "powersgd-lgreco": {"method": "powersgd", "rank": 2, "adaptive": "lgreco", "refresh": 2},
    "topk-lgreco": {"method": "topk", "topk_ratio": 0.05, "adaptive": "lgreco", "refresh": 2},
}


@pytest.mark.parametrize("mode", list(SPECS))
def test_error_feedback_sent_plus_residual_is_the_true_sum(dist, mode):
    """Over 4 steps: 2 x every average the reducer returned (the sum of both ranks' sent values)
    plus both ranks' last residuals equals the sum of every true gradient, within fp32 rounding;
    both ranks hold the same averages; and compression really dropped something."""
    steps = 4
    results = dist.run(WORLD, reduce_known, SPECS[mode], steps)
    for step in range(steps):
        for name in SHAPES:
            assert torch.equal(results[0]["reduced"][step][name],
                               results[1]["reduced"][step][name]), (step, name)
    true = _true_sum(steps)
    held_back = 0.0
    for name in SHAPES:
        sent = WORLD * sum(results[0]["reduced"][step][name] for step in range(steps))
        residual = results[0]["residual"][name] + results[1]["residual"][name]
        torch.testing.assert_close(sent + residual, true[name], rtol=0,
                                   atol=2e-5 * true[name].abs().max().item(),
                                   msg=lambda m, name=name: f"{mode} {name}: {m}")
        held_back = max(held_back, residual.abs().max().item())
    assert held_back > 1e-3, f"{mode}: nothing was held back, nothing was compressed"
    assert results[0]["levels"] == results[1]["levels"]


@pytest.mark.parametrize("mode", list(SPECS))
def test_bf16_parameters_compress_their_fp32_gradients_with_fp32_residuals(dist, mode):
    """bf16 parameters (``train.dtype = bf16``): the compressor reads each fp32 ``main_grad``,
    keeps fp32 residuals and averages into ``main_grad``, so it is bit for bit the fp32
    compressor fed the same (bf16-rounded) gradients. A residual kept in bf16 would round away
    part of what error feedback owes the next step."""
    steps = 3
    bf16 = dist.run(WORLD, reduce_known, SPECS[mode], steps, bf16=True)
    fp32 = dist.run(WORLD, reduce_known, SPECS[mode], steps, rounded=True)
    assert bf16[0]["buckets"] == fp32[0]["buckets"]  # the same tensors packed together
    for rank in range(WORLD):
        for step in range(steps):
            for name in SHAPES:
                got = bf16[rank]["reduced"][step][name]
                assert got.dtype == torch.float32
                assert torch.equal(got, fp32[rank]["reduced"][step][name]), (rank, step, name)
        for name in SHAPES:
            residual = bf16[rank]["residual"][name]
            assert residual.dtype == torch.float32
            assert torch.equal(residual, fp32[rank]["residual"][name]), (rank, name)
        # something was held back (PowerSGD sends vectors whole: their residual stays 0)
        assert max(r.abs().max() for r in bf16[rank]["residual"].values()) > 1e-3
        assert bf16[rank]["levels"] == fp32[rank]["levels"]


def test_powersgd_at_full_rank_is_the_uncompressed_average(dist):
    spec = {"method": "powersgd", "rank": 64, "min_compression_rate": 0.0}
    results = dist.run(WORLD, reduce_known, spec, 2)
    for step in range(2):
        sent = [_gradients(rank, step) for rank in range(WORLD)]
        for result in results:
            for name in SHAPES:
                # fp32 QR and two products: a few ulps of the largest element (~10 here)
                expected = (sent[0][name] + sent[1][name]) / WORLD
                torch.testing.assert_close(result["reduced"][step][name], expected, rtol=0,
                                           atol=1e-5 * expected.abs().max().item())
            # really compressed: two all-reduces (P, then Q) per bucket, none plain
            calls, _ = result["ledger"][step][("dp", "all_reduce")]
            assert calls == 2 * len(result["buckets"])


def _expected_payload(mode: str, buckets: list[list[str]]) -> dict[tuple[str, str], tuple]:
    """The ledger's (calls, payload bytes) per step, from the shapes alone (``comm.py``: an
    all-gather's payload is its gathered output, WORLD x one rank's message)."""
    spec = SPECS[mode]
    if mode == "int8":
        payload = sum(WORLD * Int8Compressor.payload_bytes(sum(math.prod(SHAPES[n]) for n in b))
                      for b in buckets)
        assert payload < sum(4 * math.prod(s) for s in SHAPES.values()) * 0.6
        return {("dp", "all_gather"): (len(buckets), payload)}
    if mode == "topk":
        k = sum(max(1, math.ceil(spec["topk_ratio"] * math.prod(s))) for s in SHAPES.values())
        return {("dp", "all_gather"): (len(buckets), WORLD * 8 * k)}
    rank, first, second, calls = spec["rank"], 0, 0, len(buckets)
    for bucket in buckets:
        matrices = 0
        for name in bucket:
            shape = SHAPES[name]
            rows, cols = shape[0], math.prod(shape[1:])
            if len(shape) >= 2 and (rows + cols) * rank * 2.0 < rows * cols:
                first, second, matrices = first + 4 * rows * rank, second + 4 * cols * rank, 1
            else:
                first += 4 * rows * cols
        calls += matrices
    return {("dp", "all_reduce"): (calls, first + second)}


@pytest.mark.parametrize("mode", ["int8", "topk", "powersgd"])
def test_the_ledger_counts_the_compressed_bytes(dist, mode):
    results = dist.run(WORLD, reduce_known, SPECS[mode], 2)
    for result in results:
        expected = _expected_payload(mode, result["buckets"])
        for step in range(2):
            assert result["ledger"][step] == expected, (mode, step)


def test_lgreco_changes_levels_and_stays_in_agreement(dist):
    """PowerSGD under L-GreCo re-chooses per-tensor ranks on its refresh steps; both ranks pick
    the same (the error table is summed over the group first) and the ledger adds that one small
    all-reduce on those steps only."""
    results = dist.run(WORLD, reduce_known, SPECS["powersgd-lgreco"], 2)
    assert results[0]["levels"] == results[1]["levels"]
    # the exactly rank-1 embedding gradient goes down to rank 1 (levels 0 and 1 are both rank 1
    # at a configured rank of 2): fewer bytes at no cost in error
    assert results[0]["levels"]["embed"] in (0, 1), results[0]["levels"]
    plain = results[0]["ledger"][1][("dp", "all_reduce")][0]  # step 1 does not refresh
    assert results[0]["ledger"][0][("dp", "all_reduce")][0] == plain + 1


BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "optim.warmup_steps": 2, "optim.lr": 3e-3,
        "train.eval_every": 0, "metrics.comm": True, "train.grad_bucket_mb": 0.02}
MODES = {
    "none": {},
    "int8": {"parallel.grad_compression": "int8"},
    "topk": {"parallel.grad_compression": "topk", "parallel.compression_topk_ratio": 0.05},
    "powersgd": {"parallel.grad_compression": "powersgd", "parallel.compression_rank": 4},
    "powersgd-lgreco": {"parallel.grad_compression": "powersgd", "parallel.compression_rank": 4,
                        "parallel.compression_adaptive": "lgreco",
                        "parallel.compression_refresh": 5},
}


def train_and_count(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    losses, payload, wire = [], [], []
    for _ in range(steps):
        losses.append(trainer.train_step()["loss"])
        records = [r for (axis, op), r in trainer.ledger.records.items()
                   if axis == "dp" and op in ("all_reduce", "all_gather")]
        payload.append(sum(r.payload_bytes for r in records))
        wire.append(sum(r.wire_bytes for r in records))
        trainer.ledger.reset()
    return {"loss": losses, "payload": payload, "wire": wire,
            "param_bytes": sum(4 * p.numel() for p in trainer.model.parameters())}


# bf16 parameters (fp32 main_grads compressed): matrix; CI trains them in the resume test
@pytest.mark.parametrize("mode, dtype", [(mode, "fp32") for mode in MODES]
                         + [pytest.param("powersgd", "bf16", marks=pytest.mark.matrix)])
def test_training_with_each_mode_learns(dist, small_data_dir, mode, dtype):
    """20 steps of the debug model at dp = 2: the loss falls (the mean of the last 5 steps well
    below the first step's) and the compressed modes put fewer gradient bytes on the wire than
    none (an all-gather's payload counts every rank's message, so wire bytes compare)."""
    config = layout_config({**BASE, **MODES[mode], "train.steps": 20, "train.dtype": dtype},
                           WORLD, dp_replicate=WORLD)
    result = dist.run(WORLD, train_and_count, config, small_data_dir, 20)[0]
    losses = result["loss"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    params = result["param_bytes"]
    # the 1-element loss all-reduce rides along; none all-reduces every fp32 gradient once:
    # 2 (n-1)/n of it on the wire, the same bytes at n = 2
    if mode == "none":
        assert result["payload"][3] == params + 4 and result["wire"][3] == params + 4
    else:
        assert result["wire"][3] < params / 2, result["wire"][3]


def train_save_resume(ctx, config_table: dict, data_dir: str, run_dir: str, steps: int) -> dict:
    """Train ``steps`` steps straight, saving halfway; then resume from that checkpoint in a new
    trainer and train to ``steps`` again: both weights, and the compressor's state."""
    straight = Trainer(from_dict(config_table), Path(data_dir), Path(run_dir), ctx)
    for _ in range(steps // 2):
        straight.train_step()
    straight.save_checkpoint()
    while straight.step < steps:
        straight.train_step()
    resumed = Trainer(from_dict(config_table), Path(data_dir), Path(run_dir), ctx)
    resumed.resume("auto", log=lambda msg: None)
    while resumed.step < steps:
        resumed.train_step()

    def state(trainer):
        compressor = trainer.pipeline.reducers[0].compressor
        held = {k: v.clone() for k, v in compressor.state_dict().items()}
        if trainer.expert_compressor is not None:  # ep: the expert shards' own
            held.update({f"experts.{k}": v.clone()
                         for k, v in trainer.expert_compressor.state_dict().items()})
        return ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, held)
    return {"straight": state(straight), "resumed": state(resumed)}


# bf16: bf16 parameters, fp32 masters, the fp32 residuals in the checkpoint
@pytest.mark.parametrize("mode, dtype", [("powersgd-lgreco", "fp32"), ("int8", "fp32"),
                                         ("powersgd-lgreco", "bf16")])
def test_resume_restores_the_residuals_bit_exactly(dist, small_data_dir, tmp_path, mode,
                                                   dtype):
    config = layout_config({**BASE, **MODES[mode], "train.steps": 6, "train.dtype": dtype,
                            "parallel.compression_refresh": 2}, WORLD, dp_replicate=WORLD)
    for rank, result in enumerate(dist.run(WORLD, train_save_resume, config, small_data_dir,
                                           str(tmp_path), 6)):
        (weights, state), (weights_again, state_again) = result["straight"], result["resumed"]
        assert set(state) == set(state_again)
        for name, value in {**weights, **state}.items():
            again = {**weights_again, **state_again}[name]
            assert torch.equal(value, again), f"rank {rank} {mode}: {name} differs after resume"
        assert any(v.abs().sum() > 0 for k, v in state.items() if k.startswith("residual"))


def save_then_resume_under(ctx, saved: dict, resumed: dict, data_dir: str, run_dir: str) -> dict:
    """Train 2 steps under ``saved`` and checkpoint; resume under ``resumed``, train 2 more."""
    first = Trainer(from_dict(saved), Path(data_dir), Path(run_dir), ctx)
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    second = Trainer(from_dict(resumed), Path(data_dir), Path(run_dir), ctx)
    second.resume("auto", log=lambda msg: None)
    weights = {n: p.detach().clone() for n, p in second.model.named_parameters()}
    losses = [second.train_step()["loss"] for _ in range(2)]
    compressor = second.pipeline.reducers[0].compressor
    residuals = [] if compressor is None else \
        [float(r.abs().sum()) for r in compressor.residual]
    same = all(torch.equal(p, weights[n]) for n, p in first.model.named_parameters())
    return {"step": second.step, "losses": losses, "weights_loaded": same,
            "residual_sum": sum(residuals)}


@pytest.mark.parametrize("saved, resumed", [("none", "int8"), ("int8", "topk"),
                                            ("powersgd", "none")])
def test_resume_under_another_compression_restarts_it(dist, small_data_dir, tmp_path, saved,
                                                      resumed):
    """A checkpoint saved under another compression (or none) loads: weights and optimizer as
    always, the compression state restarted (zero residuals, then the new mode's own)."""
    configs = [layout_config({**BASE, **MODES[mode], "train.steps": 4}, WORLD,
                             dp_replicate=WORLD) for mode in (saved, resumed)]
    for result in dist.run(WORLD, save_then_resume_under, *configs, small_data_dir,
                           str(tmp_path)):
        assert result["weights_loaded"] and result["step"] == 4
        assert all(math.isfinite(loss) for loss in result["losses"])
        assert (result["residual_sum"] > 0) == (resumed != "none")


@pytest.mark.parametrize("mode, degrees", [
    # pipeline stages: each stage's reducer compresses (with the runtime's flush after a W)
    ("powersgd-lgreco", {"pp": 2, "dp_replicate": 2, "schedule": "zbv"}),
    # tensor parallelism: the local shards of DTensor gradients are compressed
    ("topk", {"tp": 2, "dp_replicate": 2, "sequence_parallel": True}),
])
def test_compression_composes_with_pp_and_tp(dist, small_data_dir, mode, degrees):
    config = layout_config({**BASE, **MODES[mode], "train.steps": 6}, 4, **degrees)
    for result in dist.run(4, train_and_count, config, small_data_dir, 6):
        assert result["loss"][-1] < result["loss"][0] - 0.5, result["loss"]


# -- expert parallelism: the expert shards' reduction has a compressor of its own --------------
MOE = {"model.preset": "tiny-moe", "train.global_batch_size": 8, "train.micro_batch_size": 2}


def experts_step(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``steps`` steps of an MoE model over dp_replicate x ep: the logged losses, the first
    step's gradients (gathered, by name: experts stacked over ep), the data-parallel
    all-reduce bytes of the last step and the compressors' residuals."""
    from loom.train.full_state import named_gradients

    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    losses, first = [], None
    for step in range(steps):
        trainer.ledger.reset()
        losses.append(trainer.train_step()["loss"])
        if step == 0:
            first = {n: g.clone() for n, g in named_gradients(trainer).items()}
    reduced = trainer.ledger.get("dp", "all_reduce")
    compressor = trainer.expert_compressor
    return {"loss": losses, "grads": first, "experts": sorted(expert_parameter_names(
                trainer.model)),
            "dp_all_reduce_bytes": reduced.payload_bytes if reduced else 0,
            "expert_residual": (sum(float(r.abs().sum()) for r in compressor.residual)
                                if compressor is not None else None)}


def test_expert_gradients_are_compressed_too_and_close_to_the_exact_average(dist,
                                                                            small_data_dir):
    """dp_replicate 2 x ep 2, int8: the expert shards are averaged over the replicas by their
    own compressor (no fp32 all-reduce of them is left on the dp axis, only the loss's
    scalars), with error feedback (their residuals are not zero); step 1, before any residual,
    is the exact average to int8's rounding (half a step of 1/127 of each chunk's largest
    value, per rank); the run learns."""
    steps = 8
    table = layout_config({**BASE, **MOE, "train.steps": steps}, 4, dp_replicate=2, ep=2)
    plain = layout_config({**BASE, **MOE, "train.steps": 1, "parallel.grad_compression":
                           "none"}, 4, dp_replicate=2, ep=2)
    exact = dist.run(4, experts_step, plain, small_data_dir, 1)[0]
    table["parallel"]["grad_compression"] = "int8"
    for rank, result in enumerate(dist.run(4, experts_step, table, small_data_dir, steps)):
        assert result["experts"], "tiny-moe has expert weights"
        assert result["dp_all_reduce_bytes"] <= 64, (rank, result["dp_all_reduce_bytes"])
        assert result["expert_residual"] > 0, rank
        for name in result["experts"]:
            want, got = exact["grads"][name], result["grads"][name]
            bound = want.abs().max().item() / 127
            torch.testing.assert_close(got, want, rtol=0, atol=bound,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        assert sum(result["loss"][-3:]) / 3 < result["loss"][0] - 0.3, result["loss"]


def test_expert_compression_state_resumes_bit_exactly(dist, small_data_dir, tmp_path):
    """The expert compressor's residuals (and L-GreCo's levels) are saved beside the dense
    reducer's and restored: a resumed run ends bit-identical to the straight one."""
    config = layout_config({**BASE, **MOE, **MODES["powersgd-lgreco"], "train.steps": 4,
                            "parallel.compression_refresh": 2}, 4, dp_replicate=2, ep=2)
    for rank, result in enumerate(dist.run(4, train_save_resume, config, small_data_dir,
                                           str(tmp_path), 4)):
        (weights, state), (weights_again, state_again) = result["straight"], result["resumed"]
        assert any(k.startswith("experts.residual") for k in state), sorted(state)[:5]
        for name, value in {**weights, **state}.items():
            again = {**weights_again, **state_again}[name]
            assert torch.equal(value, again), f"rank {rank}: {name} differs after resume"


def skip_a_poisoned_step(ctx, config_table: dict, data_dir: str) -> list[dict]:
    """A NaN gradient in one rank's attention matrix at step 1 (train.nonfinite = skip)."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    weight = trainer.model.layers["0"].attention.wq.weight
    if ctx.rank == 0:
        weight.register_hook(lambda g: g * math.nan if trainer.step == 0 else g)
    return [trainer.train_step() for _ in range(3)]


@pytest.mark.parametrize("mode", ["int8", "powersgd", "topk"])
def test_a_skipped_non_finite_step_does_not_poison_the_residuals(dist, small_data_dir, mode):
    """The skipped step's residual would carry the NaN into every later step (and stop the run
    at train.max_skipped_steps); it is dropped instead, so the next steps are finite."""
    config = layout_config({**BASE, **MODES[mode], "train.steps": 3, "train.nonfinite": "skip"},
                           WORLD, dp_replicate=WORLD)
    for steps in dist.run(WORLD, skip_a_poisoned_step, config, small_data_dir):
        assert not math.isfinite(steps[0]["grad_norm"]) and steps[0]["skipped_steps"] == 1
        for later in steps[1:]:
            assert math.isfinite(later["grad_norm"]) and later["skipped_steps"] == 1, steps
