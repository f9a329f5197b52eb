"""The rollback copy restores every bit, the post-validated step equals the synchronous one on
one process (including a non-finite loss whose gradients are finite, so the optimistic step
really happened), and the config refuses the layouts it does not support, by name.

The pipeline and data-parallel cases, where the norm or the loss arrive from other ranks, are
tests/dist/test_post_validation.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.config import ConfigError, load_config, resolve
from loom.train.optim import build_optimizer
from loom.train.post_validation import (OptimizerSnapshot, PendingMean, PostValidatedStep,
                                        SynchronousStep)

torch.set_num_threads(1)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.Linear(16, 4))


def _optimizer(model: nn.Module) -> torch.optim.AdamW:
    return build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _backward(model: nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    loss = (model(x) - y).pow(2).mean() * (3.0 if step % 2 else 0.1)  # some steps clip
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()


def _bits(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[bytes]:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for p in model.parameters() for _, v in sorted(optimizer.state[p].items())]
    return [t.flatten().view(torch.uint8).numpy().tobytes() for t in tensors]


def test_restore_undoes_a_step_exactly_including_the_first():
    model = _model()
    optimizer = _optimizer(model)
    snapshot = OptimizerSnapshot(optimizer)
    for step in range(3):
        _backward(model, step)
        before = _bits(model, optimizer)
        had_state = len(optimizer.state)
        snapshot.save()
        optimizer.step()
        assert _bits(model, optimizer) != before
        snapshot.restore()
        assert _bits(model, optimizer) == before and len(optimizer.state) == had_state
        optimizer.step()  # the redo is the step that would have happened
    n = sum(p.numel() for p in model.parameters())
    assert snapshot.nbytes() == 3 * 4 * n + 4 * len(list(model.parameters()))  # p, m, v + step


@pytest.mark.parametrize("nonfinite_step", [None, 2])
def test_post_validated_equals_synchronous_on_one_process(nonfinite_step):
    runs = []
    for kind in (SynchronousStep, PostValidatedStep):
        model = _model()
        optimizer = _optimizer(model)
        step_fn = kind(optimizer, model, lambda v: PendingMean(v, None, 1, axis="dp"),
                       max_norm=0.5, nonfinite="skip")
        outcomes = []
        for step in range(5):
            loss = _backward(model, step)
            if step == nonfinite_step:  # a non-finite loss whose gradients are finite
                loss = loss * float("inf")
            outcomes.append(step_fn(loss, f"at step {step + 1}"))
        runs.append((outcomes, _bits(model, optimizer)))
    # The norm is local here, so clipping precedes the step: only the non-finite step rolls back.
    assert step_fn.rollbacks == (nonfinite_step is not None)
    (sync_outcomes, sync_bits), (post_outcomes, post_bits) = runs
    assert [o.grad_norm for o in post_outcomes] == [o.grad_norm for o in sync_outcomes]
    assert [o.applied for o in post_outcomes] == [o.applied for o in sync_outcomes] == [
        step != nonfinite_step for step in range(5)]
    assert post_bits == sync_bits
    assert any(o.grad_norm > 0.5 for o in sync_outcomes)  # clipping was active


def test_stop_raises_naming_the_step_with_the_weights_restored():
    model = _model()
    optimizer = _optimizer(model)
    step_fn = PostValidatedStep(optimizer, model, lambda v: PendingMean(v, None, 1, axis="dp"),
                                max_norm=1.0, nonfinite="stop")
    loss = _backward(model, 0)
    before = _bits(model, optimizer)
    with pytest.raises(FloatingPointError, match="at step 1 on rank 0"):
        step_fn(loss * float("nan"), "at step 1 on rank 0")
    assert _bits(model, optimizer) == before


@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero_1_and_2_are_refused_by_name(stage):
    with pytest.raises(ConfigError) as info:
        resolve(load_config(None, {"parallel.dp_shard": "2", "parallel.zero_stage": stage,
                                   "train.post_validation": "true"}), 2)
    assert info.value.field_name == "train.post_validation"
    assert f"ZeRO-{stage} (dp_shard = 2" in str(info.value)
    assert "train.post_validation = false" in str(info.value)


@pytest.mark.parametrize("overrides, world_size", [
    ({"parallel.pp": "2", "parallel.dp_replicate": "2", "train.global_batch_size": "8",
      "train.micro_batch_size": "1"}, 4),
    ({"parallel.cp": "2"}, 2),
    ({}, 1),
    ({"parallel.tp": "2", "parallel.pp": "2"}, 4),
    ({"model.n_experts": "4", "parallel.ep": "2"}, 2),
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "3", "parallel.pp": "2"}, 4),
])
def test_pipeline_data_tensor_expert_parallel_and_fsdp_layouts_are_accepted(overrides, world_size):
    config = resolve(load_config(None, {**overrides, "train.post_validation": "true"}),
                     world_size)
    assert config.train.post_validation
