"""``loom.models.norm.RMSNorm``: torch's RMSNorm arithmetic, saving only its input and rstd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.models.norm import RMSNorm, _RMSNormFunction


def _pair(dtype: torch.dtype) -> tuple[nn.RMSNorm, RMSNorm]:
    torch.manual_seed(0)
    weight = torch.randn(64) * 0.5 + 1
    reference, ours = nn.RMSNorm(64, eps=1e-5), RMSNorm(64, eps=1e-5)
    for norm in (reference, ours):
        norm.weight.data.copy_(weight)
    return reference.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_torchs_and_backward_its_gradient(dtype):
    reference, ours = _pair(dtype)
    x = (torch.randn(3, 17, 64) * 3).to(dtype)
    grad = torch.randn(3, 17, 64).to(dtype)
    results = []
    for norm in (reference, ours):
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        results.append((out, xi.grad, norm.weight.grad))
    (ref_out, ref_dx, ref_dw), (out, dx, dw) = results
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert torch.equal(out, ref_out)  # the same fp32 arithmetic, cast once
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else \
        dict(rtol=1.6e-2, atol=1e-2)  # one bf16 rounding of either result
    torch.testing.assert_close(dx, ref_dx, **tolerance)
    torch.testing.assert_close(dw, ref_dw, **tolerance)


def test_its_gradient_is_the_numerical_one():
    torch.manual_seed(1)
    norm = RMSNorm(8, eps=1e-5).double()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-5),
                                    (x, norm.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_saves_the_input_and_one_scale_per_row(dtype):
    _, ours = _pair(dtype)
    x = torch.randn(4, 32, 64, dtype=dtype, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours(x)
    activations = [t for t in saved if t is not ours.weight]
    assert sum(t.numel() * t.element_size() for t in activations) == \
        x.numel() * x.element_size() + 4 * 32 * 4  # x, and rstd in fp32 per row


def test_state_dict_and_repr_are_torchs():
    reference, ours = _pair(torch.float32)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    assert repr(ours) == repr(reference)
    assert isinstance(ours, nn.RMSNorm)



def test_compiled_it_is_torchs_rms_norm():
    """Inside ``torch.compile`` the module is ``F.rms_norm``: inductor on CUDA gave the Function's
    weight a zero gradient (measured on an H100, torch 2.11; tests/gpu), so a compiled block must
    not trace it. The graph dynamo captures holds torch's rms_norm and no autograd Function, and
    the compiled module's gradients are the eager ones."""
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    _, ours = _pair(torch.float32)
    x = torch.randn(2, 5, 64)
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(eager_x).square().sum().backward()
    eager_grads = (eager_x.grad, ours.weight.grad.clone())
    ours.weight.grad = None
    torch._dynamo.reset()
    torch.compile(ours, backend=capture, fullgraph=True)(compiled_x).square().sum().backward()
    calls = [str(node.target) for graph in graphs for node in graph.graph.nodes
             if node.op == "call_function"]
    assert any("rms_norm" in call for call in calls), calls
    assert not any("autograd_function" in call for call in calls), calls
    torch.testing.assert_close((compiled_x.grad, ours.weight.grad), eager_grads,
                               rtol=1e-5, atol=1e-6)
