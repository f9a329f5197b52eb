"""The optimizer step without a global barrier: Zero Bubble's post-validation.

Every optimizer step depends on two global facts: the gradient norm of the whole model (for
clipping) and whether any loss or gradient value is non-finite. The synchronous step
(``train.post_validation = false``) learns both from blocking all-reduces and only then steps.
``PostValidatedStep`` (``train.post_validation = true``) instead, on each rank:

1. computes the squared norm of the gradients it holds and starts its all-reduce over the
   model-parallel group (``pp``) without waiting; the trainer has started the loss mean over the
   data group (dp, or dp x cp) the same way (``PendingMean``). These two reductions are also the
   non-finite flag: a NaN or infinite gradient anywhere makes the summed squares NaN or infinite
   on every rank, a non-finite loss makes the mean non-finite, so no third collective is needed;
2. copies what the step will change (``OptimizerSnapshot``: each parameter with a gradient and
   its optimizer state) and steps the optimizer optimistically on the unclipped gradients;
3. waits for both results and validates. The step stands when both are finite and the clip
   coefficient min(max_norm / (norm + 1e-6), 1) is exactly 1: clipping would then multiply every
   gradient by 1.0, which changes no bit. Otherwise it restores the copy, clips with the global
   norm and redoes the step; for a non-finite value it applies ``train.nonfinite`` to the
   restored weights (stop: raise naming the step; skip: drop the gradients, apply nothing).

The outcome is bit-identical to the synchronous step: the same local norm, the same collectives
in the same precision, torch's clipping formula, and AdamW run on the same inputs from the same
state (the restore copies back every bit, and a parameter that had no optimizer state yet gets
none, so the redo initialises it as the first step would). Without a model-parallel group (pp = 1)
the norm is local and known at once, so clipping is applied before the step exactly as in the
synchronous path, and only the non-finite check is validated afterwards.

What overlaps with what: the two 4-byte all-reduces (squares over ``pp``, loss over the data
group) run in the background while the rank copies its rollback state and runs AdamW. Validation
waits at the end of ``Trainer.train_step``, before it returns the step's loss and norm, hence
before the parameters are next used (next forward, evaluation, checkpoint). Nothing can be
overlapped beyond that in Loom today: the pipeline runtime ends every step with a blocking loss
all-reduce over ``pp`` and does not start the next step's forwards inside the current step, so a
rank's optimizer step could at most hide the norm reduction's latency (docs/benchmarks.md measures
what that is worth on CPU).

Communication: the same collectives and bytes as the synchronous step; only the waiting moves.

Memory: the rollback copy holds every parameter the rank steps plus its optimizer state. For
fp32 AdamW that is parameter + exp_avg + exp_avg_sq = 12 bytes per parameter (and a 4-byte step
counter per tensor): 3/4 of the 16 B/param model state again, for the rank's own parameters only
(a pipeline rank holds 1/pp of them). The buffers are allocated once and reused every step.
With bf16 parameters (``train.dtype = bf16``) the trainer runs either step inside
``master_window``, so what is copied, stepped and restored is the fp32 masters with their fp32
gradients: the same 12 bytes per parameter. Time:
one 12 B/param copy per step, plus the restore and a second optimizer step on the steps that clip
or are non-finite.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.parallel import comm, expert, tensor  # tp's and ep's own norm formulas (bit-identical)
from loom.parallel.data import is_fully_sharded
from loom.parallel.expert import expert_parameter_names
from loom.parallel.clipping import clip_coefficient, scale_local_gradients
from loom.train.optim import (clip_gradients, clip_to_norm, dtensor_grad_squares,
                              local_grad_norm, tied_replicas)


class PendingMean:
    """The mean of a per-rank scalar over ``group`` (``size`` ranks), all-reduced in the
    background from construction; ``result()`` waits and returns it as a float."""

    def __init__(self, value: torch.Tensor, group: Any, size: int, *, axis: str,
                 ledger: Any = None) -> None:
        self.value, self.size, self.work = value, size, None
        if size > 1:
            self.value = value.clone()
            self.work = comm.all_reduce(self.value, group, axis=axis, ledger=ledger,
                                        async_op=True)

    def result(self) -> float:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.value /= self.size
        return float(self.value)


def apply_if_finite(optimizer: torch.optim.Optimizer, loss: float, norm: float,
                    nonfinite: Literal["stop", "skip"], where: str) -> bool:
    """Step when the global loss and gradient norm are finite; otherwise ``stop`` raises
    (naming ``where``, e.g. "at step 3 on rank 1") and ``skip`` drops the gradients. Every rank
    sees the same two numbers, so every rank decides the same. Returns whether it stepped."""
    if math.isfinite(loss) and math.isfinite(norm):
        optimizer.step()
        return True
    if nonfinite == "stop":
        raise FloatingPointError(f"non-finite loss ({loss}) or gradient norm ({norm}) {where};"
                                 " the step was not applied (train.nonfinite=stop)")
    optimizer.zero_grad(set_to_none=True)
    return False


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tp shard's (DTensor's) local tensor, sharing its storage; others as they are. The
    snapshot copies shards: DTensor has no ``_foreach_copy_``, and each rank owns its shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])``, fused per device pair (a step counter may live on the
    host while its parameter is on an accelerator)."""
    pairs: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for target, source in zip(targets, sources):
        pair = pairs[(target.device, source.device)]
        pair[0].append(target)
        pair[1].append(source)
    for dsts, srcs in pairs.values():
        torch._foreach_copy_(dsts, srcs)


class OptimizerSnapshot:
    """A copy of everything ``optimizer.step()`` is about to change, and its exact restore.

    Covers each parameter that has a gradient (AdamW leaves the others alone) and every tensor
    of its optimizer state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``; AdamW keeps no
    non-tensor per-parameter state). A parameter without state before the step is restored to
    having none. Buffers are reused across steps while the shapes stay the same.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._entries: list[tuple[nn.Parameter, tuple[str, ...] | None]] = []
        self._buffers: list[torch.Tensor] = []

    def save(self) -> None:
        entries, sources = [], []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.optimizer.state.get(param)  # .get: the state is a defaultdict
                keys = tuple(sorted(k for k, v in state.items() if torch.is_tensor(v))) \
                    if state else None
                entries.append((param, keys))
                sources.append(_local(param.detach()))
                sources.extend(_local(state[k]) for k in keys or ())
        layout = [(s.shape, s.dtype, s.device) for s in sources]
        if layout != [(b.shape, b.dtype, b.device) for b in self._buffers]:
            self._buffers = [torch.empty_like(s) for s in sources]
        _copy(self._buffers, sources)
        self._entries = entries

    def restore(self) -> None:
        targets = []
        for param, keys in self._entries:
            targets.append(_local(param.detach()))
            if keys is None:
                self.optimizer.state.pop(param, None)
            else:
                state = self.optimizer.state[param]
                targets.extend(_local(state[k]) for k in keys)
        _copy(targets, self._buffers)

    def nbytes(self) -> int:
        """Bytes held by the rollback copy."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


@dataclass(frozen=True)
class StepOutcome:
    loss: float
    grad_norm: float
    applied: bool  # False: a non-finite step skipped under train.nonfinite = skip


MeanOf = Callable[[torch.Tensor], PendingMean]  # starts a per-rank loss's mean over the data


class SynchronousStep:
    """The reference step: clip with the global norm (``optim.clip_gradients``, any layout;
    blocking reductions), then the blocking loss mean, then check and step."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, mean: MeanOf, *,
                 max_norm: float, nonfinite: Literal["stop", "skip"], tp: Any = None,
                 ep: Any = None, zero: Any = None, pp_group: dist.ProcessGroup | None = None,
                 norm_is_local: bool = False) -> None:
        self.optimizer, self.model, self.mean = optimizer, model, mean
        self.max_norm, self.nonfinite = max_norm, nonfinite
        self.tp, self.ep, self.zero, self.pp_group = tp, ep, zero, pp_group
        self.norm_is_local = norm_is_local

    def __call__(self, loss_sum: torch.Tensor, where: str) -> StepOutcome:
        """One step of the gradients now in the model; ``loss_sum`` is this rank's loss,
        ``where`` names the step for a stop message."""
        grad_norm = clip_gradients(self.model, self.max_norm, tp=self.tp, ep=self.ep,
                                   zero=self.zero, pp_group=self.pp_group)
        norm = float(grad_norm)
        if self.norm_is_local and not math.isfinite(norm):
            # The norm is this replica's (an outer dp_mode) but the loss mean spans every
            # replica: a NaN in it makes every rank take the same stop or skip decision, where a
            # replica stopping alone would leave the others waiting in the next collective.
            loss_sum = loss_sum + float("nan")
        loss = self.mean(loss_sum).result()
        return StepOutcome(loss, norm, apply_if_finite(self.optimizer, loss, norm,
                                                       self.nonfinite, where))


class PostValidatedStep:
    """Clip, check and step, with the global norm and loss validated after the optimistic step.

    ``pp_group``: the group the squared gradient norm is summed over (a pipeline's), or None
    when every rank holds whole gradients (data parallelism: the reduced gradients, hence their
    norm, are the same everywhere). ``tp`` / ``ep`` (their ``TensorParallel`` /
    ``ExpertParallel``): the norm's squares are first summed over those groups, blocking, as
    the synchronous step does (``tensor.grad_squares``, ``expert.grad_squares``); only the sum
    over pp runs behind the optimistic step. A tied embedding's replica is left out of the
    squares and scaled like the rest (``optim.clip_gradients``). FSDP2 (ZeRO-3): the buckets'
    squares over their mesh dims first (``optim.dtensor_grad_squares``); the rollback restores
    each rank's shards. ZeRO-1/2, whose step re-gathers the slices it stepped, is not
    supported: ``optimizer_step_for`` and ``loom.config_rules`` refuse it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, mean: MeanOf, *,
                 max_norm: float, nonfinite: Literal["stop", "skip"],
                 pp_group: dist.ProcessGroup | None = None, tp: Any = None,
                 ep: Any = None) -> None:
        self.optimizer, self.model, self.mean = optimizer, model, mean
        self.max_norm, self.nonfinite, self.pp_group = max_norm, nonfinite, pp_group
        self.tp, self.ep = tp, ep
        # FSDP2 (ZeRO-3): DTensor gradients, each bucket's squares over its mesh dims
        self.fully_sharded = is_fully_sharded(model)
        self.snapshot = OptimizerSnapshot(optimizer)
        self.rollbacks = 0  # steps restored after validation (then redone clipped, or skipped)

    def _squares(self) -> torch.Tensor:
        """The squared norm of the gradients under tp / ep, summed over everything but pp."""
        hidden = [p for p in tied_replicas(self.model) if p.grad is not None]
        grads = [p.grad for p in hidden]
        for param in hidden:  # counted on the rank holding the original
            param.grad = None
        try:
            if self.fully_sharded:
                return dtensor_grad_squares([p for p in self.model.parameters()
                                             if p.grad is not None], self._experts())
            if self.ep is not None:
                return expert.grad_squares(self.model, self.ep, self.tp)
            return tensor.grad_squares(self.model.parameters(), tp=self.tp)
        finally:
            for param, grad in zip(hidden, grads):
                param.grad = grad

    def _experts(self) -> tuple[set[int], Any] | None:
        """``optim.clip_gradients``' experts argument under FSDP2: their ids and the ep group."""
        if self.ep is None:
            return None
        names = expert_parameter_names(self.model)
        return {id(p) for n, p in self.model.named_parameters() if n in names}, self.ep.group

    def _layout_norm(self) -> bool:
        """Whether the norm sums squares over other groups than pp (tp, ep, FSDP2's mesh)."""
        return self.tp is not None or self.ep is not None or self.fully_sharded

    def _clip(self, parameters: list[nn.Parameter], norm: torch.Tensor) -> None:
        if not self._layout_norm():
            clip_to_norm(parameters, self.max_norm, norm)
            return
        # tp, ep, FSDP2: every gradient's local tensor, a tied replica's too (their clip's own)
        scale_local_gradients(parameters, self.max_norm, norm)

    @torch.no_grad()
    def __call__(self, loss_sum: torch.Tensor, where: str) -> StepOutcome:
        """As ``SynchronousStep.__call__``, with the same result."""
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if not self._layout_norm():
            replicas = {id(p) for p in tied_replicas(self.model)}  # counted on another rank
            counted = [p.grad for p in parameters if id(p) not in replicas]
            norm = local_grad_norm(counted) if counted else torch.zeros(())
            squares = norm.pow(2)
        else:
            squares = self._squares()
            norm = squares.sqrt()
        pending = None
        if self.pp_group is not None and parameters:
            ledger = getattr(self.ep if self.ep is not None else self.tp, "ledger", None)
            pending = comm.all_reduce(squares, self.pp_group, axis="pp", ledger=ledger,
                                      async_op=True)
        else:  # the norm is already global: clip now, as the synchronous step does
            self._clip(parameters, norm)
        loss = self.mean(loss_sum)  # started: waited for below
        self.snapshot.save()
        self.optimizer.step()  # optimistic; validated below
        if pending is not None:
            pending.wait()
            norm = squares.sqrt()
        loss_value, norm_value = loss.result(), float(norm)
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        clips = pending is not None and self.max_norm > 0 and bool(
            clip_coefficient(norm, self.max_norm) < 1)
        if finite and not clips:
            return StepOutcome(loss_value, norm_value, True)
        self.snapshot.restore()
        self.rollbacks += 1
        if pending is not None:  # the synchronous step clips before it checks
            self._clip(parameters, norm)
        applied = apply_if_finite(self.optimizer, loss_value, norm_value, self.nonfinite, where)
        return StepOutcome(loss_value, norm_value, applied)


def optimizer_step_for(train: Any, optimizer: torch.optim.Optimizer, model: nn.Module,
                       mean: MeanOf, *, tp: Any = None, ep: Any = None, zero: Any = None,
                       pp_group: dist.ProcessGroup | None = None, norm_is_local: bool = False
                       ) -> SynchronousStep | PostValidatedStep:
    """The step ``train`` (a ``TrainConfig``) asks for: ``train.post_validation`` picks the
    post-validated step, which needs a norm that is one reduction over ``pp`` (or none).
    ``norm_is_local``: the gradient norm is one replica's (an outer dp_mode) while ``mean``
    spans the replicas (refused with post-validation, which starts the mean before the norm)."""
    kwargs = {"max_norm": train.grad_clip, "nonfinite": train.nonfinite, "pp_group": pp_group}
    if not train.post_validation:
        return SynchronousStep(optimizer, model, mean, tp=tp, ep=ep, zero=zero,
                               norm_is_local=norm_is_local, **kwargs)
    if norm_is_local:
        raise ValueError("train.post_validation with an outer parallel.dp_mode is not supported")
    if zero is not None:
        raise ValueError("train.post_validation supports plain, data-, tensor-, expert-parallel,"
                         " pipeline and FSDP2 layouts (not ZeRO-1/2: its step re-gathers slices)")
    return PostValidatedStep(optimizer, model, mean, tp=tp, ep=ep, **kwargs)
