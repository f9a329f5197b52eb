"""AdamW groups, the warmup + cosine schedule, and clipping by the global norm."""

import math

import pytest
import torch

from loom.train.optim import build_optimizer, clip_grad_norm, lr_at

torch.set_num_threads(1)


def test_warmup_is_linear_then_cosine_decays_to_the_floor():
    kw = dict(total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(109, **kw) == pytest.approx(0.1)  # and ends at the floor on the last step
    midpoint = 10 + (110 - 10 - 1) / 2
    assert lr_at(int(midpoint), **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(
        math.pi * int(midpoint - 10) / 99)))
    values = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_norm_weights_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.RMSNorm(4))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.ndim for p in decayed["params"]] == [2]
    assert plain["weight_decay"] == 0.0 and [p.ndim for p in plain["params"]] == [1]


def _params_with_grads(*grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_clip_returns_the_global_norm_and_scales_to_the_limit():
    params = _params_with_grads(torch.tensor([3.0, 0.0]), torch.tensor([[4.0]]))
    norm = clip_grad_norm(params, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    after = torch.cat([p.grad.flatten() for p in params]).norm()
    assert after.item() == pytest.approx(1.0, rel=1e-5)


def test_a_norm_below_the_limit_is_left_alone_and_zero_means_measure_only():
    params = _params_with_grads(torch.tensor([0.3, 0.4]))
    assert clip_grad_norm(params, max_norm=1.0).item() == pytest.approx(0.5)
    assert torch.equal(params[0].grad, torch.tensor([0.3, 0.4]))
    params = _params_with_grads(torch.tensor([30.0, 40.0]))
    assert clip_grad_norm(params, max_norm=0).item() == pytest.approx(50.0)
    assert torch.equal(params[0].grad, torch.tensor([30.0, 40.0]))
