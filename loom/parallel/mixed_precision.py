"""bf16 parameters with fp32 master weights for layouts whose parameters are whole on every
data-parallel rank (one rank, plain data parallelism; tensor and pipeline parallel pieces too).

``train.dtype = bf16`` is mixed precision the way large runs do it (Micikevicius et al. 2018,
Megatron-LM): forward and backward read 2-byte parameters; the optimizer steps 4-byte master
copies with 4-byte Adam moments; the gradients are accumulated and reduced in
``train.grad_reduce_dtype`` (fp32 by default). ZeRO-1/2 (``zero.py``) keep their master weights
as their fp32 slices and ZeRO-3 through FSDP2's ``MixedPrecisionPolicy`` (its sharded fp32
parameters are the masters); this module serves every layout without ZeRO.

State lives on the parameters, as Megatron keeps ``main_grad`` on them, so that everything
holding a parameter (a reducer, a pipeline W step, a tied embedding's sum) finds it without a
registry, and a Parameter shared by two pipeline stages (a tied embedding on one rank) has one
master:

* ``param.master_weight``: the fp32 value (a DTensor under tensor parallelism, like the
  parameter); the parameter itself holds its bf16 rounding.
* ``param.main_grad`` (only with ``grad_reduce_dtype = fp32``): the gradient accumulated in fp32.
  A post-accumulate hook, registered before any reducer's, adds each backward's bf16 ``.grad``
  into it and frees ``.grad``; ``gradient_of`` folds what a hook did not see (a pipeline W step
  writes ``.grad`` directly) and is what reducers read. With ``grad_reduce_dtype = bf16`` autograd
  accumulates ``.grad`` in bf16, as Megatron's ``accumulate_allreduce_grads_in_fp32 = False``.

The optimizer (plain ``torch.optim.AdamW``, the same object as in fp32) steps the masters:
``master_window`` swaps each parameter's value for its master and its gradient for the fp32 one,
for the optimizer step, clipping, the non-finite check and checkpoints; on the way out the
bf16 values are refreshed from the masters. So AdamW's state is keyed by the same Parameters
in both dtypes, its moments are fp32, and a checkpoint holds the fp32 masters under the model's
names: a bf16 run's checkpoint loads into an fp32 run and back, across layouts.

Memory per parameter (no sharding): 2 (bf16) + 4 (master) + 8 (moments) + the gradient, 4 in
fp32 (``main_grad``; 2 with ``grad_reduce_dtype = bf16``), plus a transient 4-byte fp32 copy of a
bf16 gradient inside the optimizer window when it was reduced in bf16.

Why hand-written: torch has no optimizer wrapper for master weights (``torch.amp`` is autocast,
which keeps fp32 parameters); Megatron's and Apex's are tied to their own model classes.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

MASTER = "master_weight"  # the attribute holding a parameter's fp32 master value
MAIN_GRAD = "main_grad"  # the attribute holding its fp32 accumulated gradient


def set_value(param: nn.Parameter, value: torch.Tensor) -> None:
    """Point ``param`` at ``value``'s storage, whatever its dtype. A DTensor keeps its local
    tensor in an attribute that ``.data =`` does not reach, so that is set too."""
    param.data = value
    if hasattr(value, "_local_tensor"):
        param._local_tensor = value._local_tensor


def has_master(param: nn.Parameter) -> bool:
    """Whether ``param`` is a bf16 parameter whose fp32 master this module keeps."""
    return hasattr(param, MASTER)


def fold_main_grad(param: nn.Parameter) -> None:
    """Add ``param.grad`` (bf16) into its fp32 ``main_grad`` and free it."""
    grad = param.grad
    if grad is None:
        return
    main = getattr(param, MAIN_GRAD)
    if main is None:
        setattr(param, MAIN_GRAD, grad.to(torch.float32))
    else:
        main.add_(grad)
    param.grad = None


def gradient_of(param: nn.Parameter, *, create: bool = False) -> torch.Tensor | None:
    """The gradient accumulated so far for ``param``: its fp32 ``main_grad`` when it keeps one
    (anything autograd left in ``.grad`` folded in first), else ``.grad``. ``create``: zeros
    in that dtype when there is none (an unused parameter whose reduction must still happen)."""
    if hasattr(param, MAIN_GRAD):
        fold_main_grad(param)
        if getattr(param, MAIN_GRAD) is None and create:
            setattr(param, MAIN_GRAD, torch.zeros_like(param, dtype=torch.float32))
        return getattr(param, MAIN_GRAD)
    if param.grad is None and create:
        param.grad = torch.zeros_like(param)
    return param.grad


def accumulate(param: nn.Parameter, grad: torch.Tensor) -> bool:
    """Add ``grad`` into ``param``'s fp32 ``main_grad`` if it keeps one (a pipeline W step's
    weight gradient); returns False when it does not, and the caller accumulates ``.grad``."""
    if not hasattr(param, MAIN_GRAD):
        return False
    fold_main_grad(param)
    main = getattr(param, MAIN_GRAD)
    if main is None:
        setattr(param, MAIN_GRAD, grad.to(torch.float32))
    else:
        main.add_(grad)
    return True


@torch.no_grad()
def apply_bf16_parameters(model: nn.Module, grad_dtype: torch.dtype) -> list[nn.Parameter]:
    """Make ``model``'s trainable parameters bf16, keeping their fp32 values as masters;
    with ``grad_dtype`` fp32 each also accumulates its gradient in an fp32 ``main_grad``.
    Call before anything registers gradient hooks (the fold must run first). Buffers (RoPE
    tables) stay as they are. Returns the parameters converted now (a parameter already
    converted, shared with another pipeline stage, keeps its master)."""
    converted = []
    for param in model.parameters():
        if not param.requires_grad or has_master(param) or param.dtype != torch.float32:
            continue
        master = param.data  # the fp32 storage itself becomes the master: no copy kept twice
        set_value(param, master.to(torch.bfloat16))
        setattr(param, MASTER, master)
        if grad_dtype == torch.float32:
            setattr(param, MAIN_GRAD, None)
            param.register_post_accumulate_grad_hook(fold_main_grad)
        converted.append(param)
    return converted


def mastered(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters that keep an fp32 master (each once)."""
    return [p for p in model.parameters() if has_master(p)]


@contextlib.contextmanager
def master_window(model: nn.Module) -> Iterator[None]:
    """Inside: every mastered parameter of ``model`` holds its fp32 master and, if it has one,
    its fp32 gradient (``main_grad``, or the reduced bf16 ``.grad`` in fp32), so clipping, the
    optimizer step and checkpoints see fp32 parameters. On exit the masters keep what the
    optimizer or a checkpoint load wrote, each parameter gets their bf16 rounding back, and
    the (clipped) fp32 gradient stays readable until ``clear_main_grads``: as ``main_grad``,
    or rounded to bf16 as ``.grad`` when the parameter keeps none."""
    params = mastered(model)
    compute = []
    for param in params:
        grad = gradient_of(param)
        if hasattr(param, MAIN_GRAD):
            setattr(param, MAIN_GRAD, None)
        param.grad = None
        compute.append(param.data)  # a DTensor's ``.data`` shares its local tensor
        set_value(param, getattr(param, MASTER))
        if grad is not None:
            param.grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
    try:
        yield
    finally:
        for param, value in zip(params, compute):
            master = param.data
            setattr(param, MASTER, master)
            grad, param.grad = param.grad, None
            value.copy_(master)
            set_value(param, value)
            if grad is not None and hasattr(param, MAIN_GRAD):
                setattr(param, MAIN_GRAD, grad)
            elif grad is not None:
                param.grad = grad.to(value.dtype)


def clear_main_grads(params: list[nn.Parameter]) -> None:
    """Forget the fp32 gradients of ``params`` (the optimizer's ``zero_grad``: a new step)."""
    for param in params:
        if hasattr(param, MAIN_GRAD):
            setattr(param, MAIN_GRAD, None)

