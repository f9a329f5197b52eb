"""``loom.pipeline.host_offload.SavedActivations``: what the runtime's offload moves, and that the
backward reads exactly what the forward saved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.pipeline.host_offload import SavedActivations


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_offload_moves_activations_not_weights_and_keeps_the_bits():
    x = torch.randn(5, 8)
    reference = _model()
    reference(x).square().sum().backward()

    model = _model()
    store = SavedActivations("0O0")
    with store.hooks():
        loss = model(x.requires_grad_(False)).square().sum()
    originals = [slot.tensor for slot in store.slots]  # held: their memory is not reused
    saved = {id(t): t.data_ptr() for t in originals}
    parameters = {p.data_ptr() for p in model.parameters()}
    assert store.slots and not parameters & set(saved.values())  # no weight (nor weight.t())
    nbytes = store.nbytes
    store.offload()
    assert store.offloaded and store.bytes_moved == nbytes
    assert all(slot.tensor.data_ptr() not in saved.values() for slot in store.slots)  # copies
    with pytest.raises(RuntimeError, match="still on the host"):
        loss.backward(retain_graph=True)
    store.reload()
    assert store.bytes_moved == 2 * nbytes and not store.offloaded
    loss.backward()
    for got, expected in zip(_grads(model), _grads(reference)):
        assert got.equal(expected)


def test_a_tensor_saved_twice_is_one_slot():
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    store = SavedActivations("0O1")
    with store.hooks():
        h = torch.tanh(x @ weight)  # tanh saves its output
        out = (h * h).sum()  # mul saves h twice
    assert sum(1 for slot in store.slots if slot.tensor is h) == 1
    store.offload()
    store.reload()
    out.backward()
    expected = weight.grad.clone()
    weight.grad = None
    again = torch.tanh(x @ weight)
    (again * again).sum().backward()
    assert weight.grad.equal(expected)


def test_views_of_one_storage_move_as_one_range_and_return_over_one_buffer():
    """A GPU frees a storage once, whatever views of it autograd saved: the store moves each
    storage's bytes once (not one copy per view) and reloads the views over one buffer again.
    A resident tensor (a stage's buffer) is not moved: the module keeps it anyway."""
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x, table = torch.randn(4, 8), torch.randn(4, 8)

    def forward() -> torch.Tensor:
        h = x @ weight
        return h[:, :4].sin().sum() + h.t().cos().sum() + (h * table).sum()

    forward().backward()
    expected, weight.grad = weight.grad.clone(), None

    store = SavedActivations("0O2", resident=[table])
    with store.hooks():
        out = forward()
    assert all(slot.tensor is not table for slot in store.slots)
    assert len(store.slots) == 3  # x, and two views of h (sin's and cos's inputs)
    assert store.nbytes == (x.numel() + 4 * 8) * 4  # x once, h's 32 floats once
    store.offload()
    store.reload()
    assert store.bytes_moved == 2 * store.nbytes
    h_views = [slot.tensor for slot in store.slots if slot.tensor.shape != x.shape]
    assert len({t.untyped_storage().data_ptr() for t in h_views}) == 1
    out.backward()
    assert weight.grad.equal(expected)
