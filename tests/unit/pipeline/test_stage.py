"""I followed by W gives the same input and weight gradients as one full backward B, bit for bit,
on both I/W splits (freeing and retaining), and the freeing I keeps only what W needs."""

import dataclasses

import pytest
import torch

from loom.formulas.memory import block_activation_bytes, block_weight_grad_bytes
from loom.models import TransformerArgs
from loom.parallel.activation import apply_activation_checkpointing
from loom.pipeline.profile import PipelineRecorder
from loom.pipeline.stage import PipelineStage, build_stages
from loom.schedule.families import get
from loom.schedule.ir import Action, Op, Schedule
from loom.train.trainer import cross_entropy

ARGS = TransformerArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50,
                       max_seq_len=16)
# Every kind of parameter the models have: linear biases and per-head norms (Qwen-style), MoE
# experts and router (experts' gradients are computed in I), a tied embedding and head.
VARIANTS = {
    "llama": ARGS,
    "qkv_bias_qk_norm": dataclasses.replace(ARGS, qkv_bias=True, qk_norm=True),
    "moe": dataclasses.replace(ARGS, n_experts=4, top_k=2),
    "tied": dataclasses.replace(ARGS, tie_embeddings=True),
}


def one_stage(index: int, num_stages: int, args: TransformerArgs = ARGS) -> PipelineStage:
    schedule: Schedule = get("gpipe")(num_stages, 1)
    layers = [range(i, i + 1) for i in range(num_stages)]
    return build_stages(args, schedule, layers, rank=index, device="cpu", seed=3)[index]


def gradients(args: TransformerArgs, index: int, mode: str, autocast: bool,
              recompute: str = "none"):
    """Input gradients of two microbatches and the accumulated weight gradients of stage
    ``index`` of 3, by full backwards (``mode`` "B") or by I then W ("free" / "retain")."""
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    hidden = torch.randn(2, 8, args.dim)
    targets = torch.randint(0, args.vocab_size, (2, 8))
    grad_out = None if index == 2 else torch.randn(2, 8, args.dim)
    stage = one_stage(index, 3, args)
    apply_activation_checkpointing(stage.module, recompute)
    stage.free_graph_after_input_grad = mode == "free"
    if autocast:
        stage.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    for mb in range(2):  # two microbatches: gradients accumulate
        stage.forward(mb, hidden * (mb + 1) if index else tokens, targets, cross_entropy)
    grads_in = [stage.backward(mb, grad_out) if mode == "B" else stage.backward_input(mb, grad_out)
                for mb in range(2)]
    if mode != "B":
        for mb in (1, 0):  # W may run in any order after I
            stage.backward_weight(mb)
    assert not stage.holds_activations
    return grads_in, {n: p.grad for n, p in stage.module.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("index", [0, 1, 2], ids=["first", "middle", "last"])
def test_input_then_weight_equals_full_backward(index, variant, autocast):
    args = VARIANTS[variant]
    full_in, full_w = gradients(args, index, "B", autocast)
    for mode in ("free", "retain"):
        split_in, split_w = gradients(args, index, mode, autocast)
        assert set(full_w) == set(split_w) and all(g is not None for g in split_w.values())
        for name in full_w:
            assert torch.equal(split_w[name], full_w[name]), f"{mode}: {name} differs"
            assert split_w[name].grad_fn is None, f"{mode}: {name}'s gradient keeps a graph"
        for a, b in zip(split_in, full_in):
            if index == 0:
                assert a is None and b is None
            else:
                assert torch.equal(a, b), f"{mode}: input gradient differs"


def test_a_hook_on_a_weight_runs_under_the_freeing_split():
    """A gradient hook registered on a linear's weight (``Tensor.register_hook``) changes that
    gradient under I then W as under a full backward: the freeing split leaves such a weight to
    autograd instead of computing its gradient itself."""
    torch.manual_seed(0)
    hidden, grad_out = torch.randn(2, 8, ARGS.dim), torch.randn(2, 8, ARGS.dim)
    results = {}
    for mode in ("B", "free"):
        stage = one_stage(1, 3)
        stage.free_graph_after_input_grad = mode == "free"
        weight = stage.module.layers["1"].attention.wq.weight
        weight.register_hook(lambda g: g * 3.0)
        stage.forward(0, hidden, None, cross_entropy)
        if mode == "B":
            stage.backward(0, grad_out)
        else:
            stage.backward_input(0, grad_out)
            stage.backward_weight(0)
        results[mode] = weight.grad.clone()
    assert torch.equal(results["free"], results["B"])
    assert results["B"].abs().sum() > 0


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputed_blocks_split_as_build_pipeline_chooses(recompute):
    """Selective recomputation (the attention core) keeps the freeing split; a block recomputed
    in full needs the retaining one (``build_pipeline`` turns the freeing split off for it): its
    checkpointed matmul inputs unpack once only."""
    full_in, full_w = gradients(ARGS, 1, "B", False, recompute)
    split_in, split_w = gradients(ARGS, 1, "free" if recompute == "selective" else "retain",
                                  False, recompute)
    assert all(torch.equal(a, b) for a, b in zip(split_in, full_in))
    assert all(torch.equal(split_w[name], full_w[name]) for name in full_w)


@pytest.mark.parametrize("free", [True, False], ids=["freeing", "retaining"])
def test_freeing_input_grad_keeps_only_what_weight_grad_needs(free):
    """A middle stage of one block: after the freeing I the recorder (autograd's saved tensors
    plus ``held_for_weight``) holds exactly ``block_weight_grad_bytes``, the linears' inputs
    and output gradients; the retaining I holds everything its F saved. W then frees all."""
    args = dataclasses.replace(ARGS, dim=64, ffn_dim=192, n_heads=8, n_kv_heads=4, max_seq_len=32)
    b, s = 2, 32
    stage = one_stage(1, 3, args)
    stage.free_graph_after_input_grad = free
    recorder = PipelineRecorder(0, track_memory=True, modules=[stage.module])
    recorder.step_begin()
    forward, backward_input, backward_weight = (Action(1, op, 0) for op in (Op.F, Op.I, Op.W))
    recorder.begin(forward)
    stage.forward(0, torch.randn(b, s, args.dim), training=True)
    recorder.end(forward)
    recorder.begin(backward_input)
    stage.backward_input(0, torch.randn(b, s, args.dim))
    recorder.end(backward_input, stage.held_for_weight(0))
    recorder.begin(backward_weight)
    stage.backward_weight(0)
    recorder.end(backward_weight)
    recorder.step_end()

    sizes = dict(s=s, b=b, h=args.dim, f=args.ffn_dim, a=args.n_heads, kv=args.n_kv_heads)
    saved = recorder.profile.forward_bytes[1, 0]
    held = recorder.profile.after_input_grad[1, 0]
    # F: the formula's block bytes, less the logsumexp of the flash kernel the formula counts
    # as a·s² scores' statistics (4·s·b·(2 + a) covers both; a few KiB at these sizes)
    assert abs(saved / block_activation_bytes(**sizes) - 1) < 0.02
    if free:
        assert held == block_weight_grad_bytes(**sizes)
    else:
        assert held >= saved
    assert recorder.profile.steps[0].memory[-1][1] == 0  # W released everything
