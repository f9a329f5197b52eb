"""Fused vocabulary-parallel cross entropy on the ``tp`` mesh axis (Megatron's, in fp32).

The head is column-parallel over the vocabulary (``tensor.py``), so rank r of t holds logits for
tokens [rV/t, (r+1)V/t) only, as a DTensor ``Shard(-1)`` of global shape ``[B, S, V]``. The loss is
computed from those shards without ever gathering ``[B, S, V]`` on one rank:

forward (N = b·s tokens, fp32):
  1. all-reduce MAX of the local row maxima (N elements) — the shift for a stable softmax;
  2. all-reduce SUM of [sum of exp(shifted), target logit] (2N elements); the target logit is
     taken by the one rank whose vocabulary range holds the target, zero elsewhere;
  loss_i = log(sum_exp_i) - target_logit_i.
backward: none — d loss_i / d logit_ij = softmax_ij - [j == target_i], all local; the saved
  tensor is the local softmax ``[N, V/t]``.

Per step that is 3·N·4 bytes of payload in 2 all-reduces (Megatron issues 3; the sum-exp and the
target logit share one here), through ``loom.parallel.comm``, so the ledger counts them directly.
Degree 1 or plain (unsharded) logits: ``cross_entropy`` is ``F.cross_entropy`` of the mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loom.data.packing import IGNORE_INDEX
from loom.parallel import comm
from loom.parallel.comm import CommLedger


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor, vocab_start: int,
                group: dist.ProcessGroup, ledger: CommLedger | None) -> torch.Tensor:
        local_vocab = logits_NV.shape[-1]
        row_max = logits_NV.max(dim=-1).values
        comm.all_reduce(row_max, group, axis="tp", ledger=ledger, op=dist.ReduceOp.MAX)
        shifted = logits_NV - row_max[:, None]
        local_target = targets_N - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(1, local_target[:, None]).squeeze(1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # in place: ``shifted`` is not needed again
        sums = torch.stack((exp.sum(dim=-1), target_logit))
        comm.all_reduce(sums, group, axis="tp", ledger=ledger)
        sum_exp, target_logit = sums[0], sums[1]
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad.mul_(grad_N[:, None]), None, None, None, None


def vocab_parallel_cross_entropy(logits_BSV: DTensor, targets_BS: torch.Tensor, *,
                                 ledger: CommLedger | None = None,
                                 reduction: str = "mean") -> torch.Tensor:
    """Token cross entropy of vocabulary-sharded logits (DTensor ``Shard(-1)`` on a 1-D mesh):
    the mean over every target, or (``reduction="sum"``, packed rows) the sum over the targets
    that are not ``IGNORE_INDEX`` (padding: zero loss, zero gradient); a plain scalar, identical
    on every rank of the mesh."""
    mesh = logits_BSV.device_mesh
    local = logits_BSV.to_local()  # autograd-aware; its gradient goes back as Shard(-1)
    vocab_start = mesh.get_local_rank() * local.shape[-1]  # even split: checked by tensor.py
    losses = _VocabParallelCrossEntropy.apply(local.flatten(0, 1).float(),
                                              targets_BS.flatten(0, 1), vocab_start,
                                              mesh.get_group(), ledger)
    if reduction == "sum":
        return losses.masked_fill(targets_BS.flatten(0, 1) == IGNORE_INDEX, 0.0).sum()
    return losses.mean()


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, *,
                  ledger: CommLedger | None = None, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy in fp32 (``reduction`` mean, or sum over the targets that are not
    -100): fused vocab-parallel for vocab-sharded DTensor logits, ``F.cross_entropy`` otherwise
    (the same formula as ``loom.train.trainer``)."""
    if isinstance(logits_BSV, DTensor):
        (placement,) = logits_BSV.placements  # a 1-D tp mesh
        if placement.is_shard() and placement.dim in (-1, logits_BSV.ndim - 1):
            return vocab_parallel_cross_entropy(logits_BSV, targets_BS, ledger=ledger,
                                                reduction=reduction)
        logits_BSV = logits_BSV.full_tensor()
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten(0, 1),
                           reduction=reduction)
