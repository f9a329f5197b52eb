"""Tensor parallelism (Megatron) and sequence parallelism (Megatron-SP) on the ``tp`` mesh axis.

Engine: DTensor's ``parallelize_module`` with TorchTitan's plan. Parameters become DTensors that
carry their own placement, so (a) distributed checkpointing can reshard them to another TP degree
(the checkpoint issue loads a DCP state dict into a model built for any ``t``), (b) FSDP2 composes
with them later, and (c) the collectives are torch's. They do not pass through ``comm.py``;
``comm_trace.CollectiveCounter`` counts them into the same ``CommLedger`` (``TensorParallel.
counting()``), forward and backward.

Layout per block (t = TP degree, b batch, s sequence, h model dim, elements of the activation
dtype; fp32 = 4 bytes):

* attention: ``wq``, ``wk``, ``wv`` column-parallel (split by query heads and by key/value heads;
  rank r holds query heads [rN/t, (r+1)N/t) and kv heads [rK/t, (r+1)K/t), which are exactly the
  kv heads its query heads read, so grouped-query attention needs no communication); ``wo``
  row-parallel. Rule: t divides ``n_kv_heads`` (and so ``n_heads``). With ``qkv_bias`` each
  bias is split with its weight's rows (``ColwiseParallel`` shards both). With ``qk_norm`` the
  q/k norm weights (Hd elements, shared by every head) are replicated and see their input as
  sharded by heads (dim 2), so their gradient is a partial sum over the rank's heads: DTensor
  all-reduces it (2 x Hd elements per layer, in backward) through ``match_grad_placement``.
* MLP (SwiGLU): ``w1``, ``w3`` column-parallel, ``w2`` row-parallel; GELU (``mlp = "gelu"``, no
  ``w3``): ``w1`` column-parallel, ``w2`` row-parallel, the same collectives. Rule: t divides
  ``ffn_dim``.
  An MoE block's feed-forward gets expert-TP = TP instead (``expert.apply_expert_tensor_parallel``:
  every expert split the same way, router replicated; the same two collectives as this MLP plus
  one all-reduce of the combine weights' gradient). Rule: t divides the expert hidden dim.
* without SP, per block: forward one all-reduce of the row-parallel output (b·s·h), backward one
  all-reduce of the input gradient (b·s·h) — the block input is made *one* DTensor
  (``PrepareModuleInput``) so the three q/k/v (two w1/w3) partial gradients are summed locally and
  reduced once. Per layer: 4 all-reduces, 2·(t-1)/t·b·s·h wire elements each = 8·b·s·h·(t-1)/t
  (Megatron 2021 §3.1). The residual stream, norms, embedding and head are replicated.
* with SP, the residual stream and the norms are sharded along the sequence (dim 1): per block
  forward an all-gather before (b·s·h gathered) and a reduce-scatter after (b·s·h input), backward
  the reverse pair; the same wire bytes as all-reduce, activations 1/t. A varlen microbatch
  (``data.packing = varlen``) of a length t does not divide is cut as ``torch.chunk`` cuts it
  (uneven shards); a pipeline stage's input is rebuilt with the whole length
  (``_receive_sequence_shard``). The norm weights stay replicated; their gradients are partial
  sums over sequence shards and DTensor all-reduces them (2 norms x h elements per layer, plus
  the final norm) at the end of backward.
* vocab-parallel (``vocab_parallel=True``): the embedding is split by vocabulary rows
  (row-parallel: forward all-reduce, or reduce-scatter under SP, of b·s·h), the head by vocabulary
  columns (backward all-reduce / reduce-scatter of its input gradient); the logits stay sharded
  ``[b, s, V/t]`` and ``vocab.vocab_parallel_cross_entropy`` never gathers them. Rule: t divides
  ``vocab_size``.

Degree 1: ``apply_tensor_parallel`` returns the model untouched. gloo on CPU supports every
collective used (all-reduce, all_gather_into_tensor, reduce_scatter_tensor; checked on torch 2.13).

Initialisation: ``parallelize_module(..., src_data_rank=None)`` keeps each rank's own slice of the
full value it already holds, with no communication — so call ``reset_parameters`` first (the
trainer does). For a model parallelized while still on the meta device, pass ``load_shard`` as
``reset_parameters(model, seed, load=load_shard)``: each rank computes the full seeded value and
copies in its shard, so weights are bit-identical to one process's either way.

Composition with data parallelism: torch's ``DistributedDataParallel`` does not accept DTensor
parameters (its reducer fails with "got mixed torch.Tensor and DTensor"), and torch 2.13's
``tensor.parallel.ddp._pre_dp_module_transform`` drops the DTensor parameters from
``named_parameters`` (both checked). TP x DP therefore needs a DTensor-aware data-parallel step
(FSDP2 ``fully_shard`` / ``replicate`` on the ``dp`` mesh, or an all-reduce of each local gradient
shard over ``dp``) in ``data.py``.

Gradient clipping must count each sharded element once: squares of Shard-placed gradients are
summed locally and all-reduced over ``tp``; replicated gradients (identical on every TP rank) are
added once, not all-reduced — ``clip_grad_norm`` below.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from loom.models.moe import MoEFeedForward
from loom.parallel import comm
from loom.parallel.clipping import scale_local_gradients
from loom.parallel.comm import CommLedger
from loom.parallel.comm_trace import CollectiveCounter
from loom.parallel.expert import apply_expert_tensor_parallel
from loom.parallel.mixed_precision import gradient_of
from loom.parallel.vocab import cross_entropy


@dataclass
class TensorParallel:
    """What the trainer needs after ``apply_tensor_parallel``: the mesh, the knobs, the ledger
    (``parallelize`` returns it in its record)."""

    mesh: DeviceMesh
    sequence_parallel: bool
    vocab_parallel: bool
    ledger: CommLedger | None

    def counting(self) -> ContextManager:
        """Enter around forward *and* backward to count DTensor's collectives into the ledger."""
        if self.ledger is None:
            return contextlib.nullcontext()
        return CollectiveCounter(self.ledger, {"tp": self.mesh})

    def loss(self, logits: torch.Tensor, targets_BS: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
        """Token cross entropy (mean, or sum); fused vocab-parallel when the logits are
        vocab-sharded."""
        return cross_entropy(logits, targets_BS, ledger=self.ledger, reduction=reduction)


def check_divisible(model: nn.Module, degree: int, *, vocab_parallel: bool) -> None:
    """Raise ``ValueError`` naming the rule when ``model`` cannot be split ``degree`` ways."""
    args = model.args
    rules = [("n_kv_heads", args.n_kv_heads, "key/value heads are split across TP ranks"),
             ("n_heads", args.n_heads, "query heads are split across TP ranks"),
             ("ffn_dim", args.ffn_dim, "the MLP hidden dim is split across TP ranks")]
    if vocab_parallel:
        rules.append(("vocab_size", args.vocab_size, "vocabulary rows/columns are split"))
    if args.n_experts:
        rules.append(("expert_ffn_dim", args.expert_ffn_dim or args.ffn_dim,
                      "every expert's hidden dim is split across TP ranks (expert-TP = TP)"))
    for field, value, why in rules:
        if value % degree:
            raise ValueError(f"tensor parallelism: tp={degree} must divide model.{field}={value}"
                             f" ({why}); valid tp degrees: "
                             f"{[d for d in range(1, value + 1) if value % d == 0]}")


def _block_plan(sp: bool, dense_ffn: bool = True, qk_norm: bool = False,
                gated: bool = True) -> dict[str, object]:
    """TorchTitan's plan for one ``TransformerBlock`` (module names of ``loom.models.llama``);
    without the feed-forward entries for an MoE block (``expert.apply_expert_tensor_parallel``);
    with the per-head q/k norms of a ``qk_norm`` model; without ``w3`` for a GELU MLP
    (``gated`` False)."""
    seq = Shard(1) if sp else Replicate()
    # One DTensor for the block input: with SP it is all-gathered once; without, the q/k/v (w1/w3)
    # partial input gradients are summed locally and all-reduced once instead of three times.
    attn_in = PrepareModuleInput(input_layouts=(seq, None, None),
                                 desired_input_layouts=(Replicate(), None, None))
    ffn_in = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    plan: dict[str, object] = {
        "attention": attn_in,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # Under SP the residual stream stays a DTensor sharded on dim 1, so the model's
        # ``h.shape[1]`` (which sizes the RoPE tables) is the global sequence length.
        "attention.wo": RowwiseParallel(output_layouts=seq, use_local_output=not sp),
        "feed_forward": ffn_in,
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq, use_local_output=not sp),
    }
    if not dense_ffn:
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
    elif not gated:
        del plan["feed_forward.w3"]
    if qk_norm:  # [B, S, heads/t, Hd] local heads: replicated weight, input Shard(2) (heads)
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def _ends_plan(model: nn.Module, sp: bool, vp: bool) -> dict[str, object]:
    """Embedding, final norm and head, and the stage boundaries of a pipeline slice."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        if vp:  # rows split by vocabulary: partial sums reduced (all-reduce / reduce-scatter)
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                     use_local_output=not sp)
        elif sp:  # replicated table; keep this rank's sequence slice (backward: all-gather)
            plan["tok_embeddings"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1),
                use_local_output=False)
    if model.output is not None:
        if sp:
            plan["norm"] = SequenceParallel()
        if vp:  # logits stay [B, S, V/t], a DTensor the loss recognises
            plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                             use_local_output=False)
        elif sp and not model.head_in_vocab_shards:
            plan["output"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
    # a pipeline stage receives its local sequence shard: ``_receive_sequence_shard``
    # (a head in the vocabulary shards -- vocab_pipeline's last stage, output an Identity -- does
    # too: its shards gather X themselves)
    if sp and (model.output is None or model.head_in_vocab_shards):
        # ... and sends its local shard (b*s*h/t per microbatch)
        plan["__output__"] = PrepareModuleOutput(output_layouts=Shard(1),
                                                 desired_output_layouts=Shard(1),
                                                 use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          vocab_parallel: bool, ledger: CommLedger | None = None) -> nn.Module:
    """Shard ``model`` (a ``loom.models.Transformer`` or a pipeline slice of one) over the 1-D
    ``tp_mesh``, in place; returns it. Identity at degree 1. Parameters keep their names."""
    degree = tp_mesh.size()
    if degree == 1:
        return model
    check_divisible(model, degree, vocab_parallel=vocab_parallel)
    tied = (model.args.tie_embeddings and model.tok_embeddings is not None
            and model.output is not None)
    if tied and not vocab_parallel:
        raise ValueError("tensor parallelism with tie_embeddings needs vocab_parallel=True (the"
                         " embedding and head are then split along the same vocabulary dim)")
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoEFeedForward)
        plan = _block_plan(sequence_parallel, dense_ffn=not moe, qk_norm=model.args.qk_norm,
                           gated=model.args.mlp == "swiglu")
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)
        if moe:  # same tp group, its own layout and collectives (see loom.parallel.expert)
            apply_expert_tensor_parallel(block.feed_forward, tp_mesh,
                                         sequence_parallel=sequence_parallel, ledger=ledger)
    ends = _ends_plan(model, sequence_parallel, vocab_parallel)
    root_out = ends.pop("__output__", None)
    parallelize_module(model, tp_mesh, ends, src_data_rank=None)
    if sequence_parallel and model.tok_embeddings is None:
        model.register_forward_pre_hook(_receive_sequence_shard(tp_mesh), with_kwargs=True)
    if root_out is not None:
        parallelize_module(model, tp_mesh, root_out, src_data_rank=None)
    if tied:  # both were sharded Shard(0) over vocabulary; make them one parameter again
        model.output.weight = model.tok_embeddings.weight
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(match_grad_placement)
    return model


def _receive_sequence_shard(mesh: DeviceMesh):
    """A pipeline stage's forward pre-hook under SP: its input, this rank's sequence shard,
    becomes the DTensor of the whole sequence. The whole length is the document ids' when given
    (a varlen microbatch of any length is cut unevenly, ``expert.sequence_shard_lengths``),
    else t equal shards (DTensor's ``PrepareModuleInput`` infers only that case)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x_BsD = args[0]
        if isinstance(x_BsD, DTensor):
            return None
        B, s, D = x_BsD.shape
        ids = kwargs.get("document_ids")
        S = ids.shape[1] if ids is not None else s * mesh.size()
        x_BSD = DTensor.from_local(x_BsD, mesh, [Shard(1)], run_check=False,
                                   shape=torch.Size((B, S, D)), stride=(S * D, D, 1))
        return (x_BSD, *args[1:]), kwargs
    return hook


def match_grad_placement(param: nn.Parameter) -> None:
    """Give each gradient its parameter's placement as soon as it is accumulated.

    DTensor leaves two kinds of gradient in another placement: the norm weights under SP get a
    ``Partial`` sum over sequence shards (made ``Replicate`` here: one all-reduce of h elements
    per norm per microbatch), and the vocab-parallel embedding gets a full ``Replicate`` gradient
    (its scatter-add is computed for every row; cut to this rank's ``Shard(0)`` rows here, no
    communication). Without this the optimizer and the clipping would see partial sums.
    A post-accumulate hook on each DTensor parameter; a pipeline stage's retaining I/W split,
    whose W sets ``.grad`` itself (no hook fires), calls it after each W (``loom.pipeline.stage``).
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def load_shard(param: nn.Parameter, full_value: torch.Tensor) -> None:
    """A ``reset_parameters`` load hook: keep this rank's shard of the full seeded value."""
    if not isinstance(param, DTensor):
        param.copy_(full_value)
        return
    shape, offset = compute_local_shape_and_global_offset(full_value.shape, param.device_mesh,
                                                          param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    param.to_local().copy_(full_value[index])


def full_named_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient by name (collective over ``tp``: call on every TP rank)."""
    out = {}
    for name, param in model.named_parameters():
        grad = gradient_of(param)  # a bf16 parameter's fp32 ``main_grad``, or ``.grad``
        if grad is None:
            continue
        out[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return out


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, *, tp: TensorParallel | None,
                   other_groups: tuple[tuple[str, object], ...] = ()) -> torch.Tensor:
    """Clip to a global norm ``max_norm`` (0: only measure); return the norm before clipping.

    Sharded gradients: local sum of squares, all-reduced over ``tp``. Replicated gradients: the
    same on every TP rank, counted once. ``other_groups``, ``(axis, process group)`` pairs along
    which the model is split further (e.g. ``("pp", stage_group)``), sum both.
    """
    parameters = list(parameters)
    total = grad_squares(parameters, tp=tp)
    for axis, group in other_groups:
        comm.all_reduce(total, group, axis=axis, ledger=tp.ledger if tp else None)
    norm = total.sqrt()
    scale_local_gradients(parameters, max_norm, norm)
    return norm


@torch.no_grad()
def grad_squares(parameters, *, tp: TensorParallel | None) -> torch.Tensor:
    """``clip_grad_norm``'s squared norm before ``other_groups``: the sharded gradients' squares
    all-reduced over ``tp`` (blocking) plus the replicated ones' (the post-validated step sums
    this over pp in the background, ``loom.train.post_validation``)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sharded = [l for g, l in zip(grads, local) if _is_sharded(g)]
    replicated = [l for g, l in zip(grads, local) if not _is_sharded(g)]
    zero = torch.zeros((), dtype=torch.float32, device=local[0].device if local else "cpu")
    sq = lambda ts: (torch.nn.utils.get_total_norm(ts, foreach=True).float() ** 2) if ts else zero
    sharded_sq = sq(sharded)
    if tp is not None:
        comm.all_reduce(sharded_sq, tp.mesh.get_group(), axis="tp", ledger=tp.ledger)
    return sharded_sq + sq(replicated)


