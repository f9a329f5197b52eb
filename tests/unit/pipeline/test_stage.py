"""I followed by W gives the same input and weight gradients as one full backward B."""

import pytest
import torch

from loom.models import TransformerArgs
from loom.schedule.ir import Schedule
from loom.schedule.families import get
from loom.pipeline.stage import build_stages
from loom.train.trainer import cross_entropy

ARGS = TransformerArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50,
                       max_seq_len=16)


def one_stage(index: int, num_stages: int):
    schedule: Schedule = get("gpipe")(num_stages, 1)
    layers = [range(i, i + 1) for i in range(num_stages)]
    return build_stages(ARGS, schedule, layers, rank=index, device="cpu", seed=3)[index]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["first", "middle", "last"])
def test_input_then_weight_equals_full_backward(index):
    torch.manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    hidden = torch.randn(2, 8, ARGS.dim)
    inputs = tokens if index == 0 else hidden
    targets = torch.randint(0, ARGS.vocab_size, (2, 8))
    grad_out = None if index == 2 else torch.randn(2, 8, ARGS.dim)
    results = []
    for split in (False, True):
        stage = one_stage(index, 3)
        grads_in = []
        for mb in range(2):  # two microbatches: gradients accumulate
            stage.forward(mb, inputs * (mb + 1) if index else inputs, targets, cross_entropy)
        for mb in range(2):
            if split:
                grads_in.append(stage.backward_input(mb, grad_out))
            else:
                grads_in.append(stage.backward(mb, grad_out))
        if split:
            for mb in (1, 0):  # W may run in any order after I
                stage.backward_weight(mb)
        assert not stage.holds_activations
        results.append((grads_in, {n: p.grad for n, p in stage.module.named_parameters()}))
    (full_in, full_w), (split_in, split_w) = results
    assert set(full_w) == set(split_w) and all(g is not None for g in split_w.values())
    for name in full_w:
        torch.testing.assert_close(split_w[name], full_w[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for a, b in zip(split_in, full_in):
        if index == 0:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
