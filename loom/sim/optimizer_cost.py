"""The HBM traffic of a step's gradient handling and optimizer step, per training stack.

Beyond the layer passes and the collectives, a step moves every parameter's gradient, master
weight and optimizer state through memory a few times: gradients accumulated over the m
microbatches, the clipping norm read and the gradients scaled, AdamW's read-modify-write, and,
with 16-bit parameters, the updated fp32 masters rounded back into the parameters the GEMMs
read. These are element-wise kernels, memory-bound, so their time is bytes over the HBM
bandwidth. This module counts those bytes per parameter from each stack's code path. Nothing
here is fitted to a measurement. The cost model (``loom.sim.cost_model``) prices
``StepTraffic.full`` per parameter the rank holds (its whole local gradient: tensor- and
pipeline-parallel pieces, never a ZeRO slice) and ``StepTraffic.shard`` per parameter the rank
steps (its ZeRO slice, or everything it holds without ZeRO). Torch-free.

Notation: m microbatches; "master" means 16-bit (bf16) parameters with fp32 masters that the
optimizer steps, otherwise parameters are fp32 (``train.dtype`` fp32 or bf16_autocast: the
casts autocast makes per use belong to the layer passes and are not counted here, nor are
FSDP2's float8 all-gather's); A the AdamW step, 28 fused (torch's ``_fused_adamw``, Apex's and
Transformer Engine's multi-tensor Adam: p, g, m and v read, p, m and v written, fp32) and 80
otherwise: torch's foreach AdamW (``torch.optim.adam._multi_tensor_adam``, read in torch 2.13)
runs eight passes, the decoupled decay ``p *= 1 - lr wd`` (8), ``lerp_`` of m (12), ``v *=
beta2`` (8), ``addcmul_`` of v (12), ``sqrt`` of v into a temporary (8), its ``div_`` and
``add_`` of eps (8 + 8) and the ``addcdiv_`` of p (16); the single-tensor loop runs the same
ops. The norm is 4 bytes per gradient element where it is one read (``torch._foreach_norm``,
Apex's ``multi_tensor_l2norm``) and 12 where the code squares into a temporary and sums it
(``g.float().pow(2).sum()``); the scale by the clipping factor reads and writes (8). A byte
count per parameter, per step (the norm is measured with clipping off too: ``grad_clip = 0``
still computes it; only the scale goes):

* **Loom, no ZeRO** (``loom.parallel.mixed_precision``; ``loom.train.optim``; the trainer's
  ``master_window``). Master: the post-accumulate hook folds each microbatch's bf16 ``.grad``
  into the fp32 ``main_grad`` (``fold_main_grad``): the first time ``grad.to(float32)`` (2 + 4),
  then ``main.add_(grad)`` (4 + 2 read, 4 written): full 6 + 10(m-1). Inside ``master_window``
  the fp32 gradient is already fp32 (no copy); clipping ``get_total_norm(foreach)`` (4) and
  ``clip_grads_with_norm_`` (8, it multiplies even when the factor is 1), tensor-parallel the
  same (``loom.parallel.tensor.clip_grad_norm``); A; on the way out ``value.copy_(master)``
  (4 + 2). Shard (everything held): 12 + A + 6. fp32: autograd accumulates ``.grad`` in place
  after the first microbatch (``AccumulateGrad``: 4 + 4 + 4): full 12(m-1); shard 12 + A.
  A is fused unless the parameter list mixes DTensors and plain tensors
  (``loom.formulas.memory.adamw_step_fused``, the same rule the memory model uses).
* **Loom, ZeRO-1** (``loom.parallel.zero``, stage 1). The gradients are views of a zeroed
  full-size buffer, so every microbatch adds into it: master 10m (the fold's ``add_``), fp32 12m
  (autograd's in-place accumulation), plus the ``zero_()`` of the buffer in ``zero_grad`` (4):
  full 10m + 4 or 12m + 4. Shard: ``finish`` copies the reduced slice and divides it (8 + 8),
  clipping squares into a temporary (12) and scales (8), A fused (flat slices), and
  ``gather_parameters`` copies the slice into the all-gather's input in the parameters' dtype
  (4 + 2 master, 4 + 4 fp32): 16 + 20 + A + 6 (or 8).
* **Loom, ZeRO-2**. Gradients accumulate per parameter as without ZeRO until the last backward
  (``sync`` off: full 6 + 10(m-1), or 12(m-1)), then ``_pack`` zero-fills each bucket's fp32
  packing buffer (4) and copies the gradient in (8): full + 12. Shard as ZeRO-1.
  (``train.grad_reduce_every_microbatch``, reducing every microbatch, is not priced.)
* **Loom, ZeRO-3** (FSDP2, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when
  master; torch 2.13 ``_fully_shard``). With ``sync`` off for the first m-1 microbatches FSDP2
  upcasts the first unsharded bf16 gradient (``to_accumulated_grad_if_needed``: 6) and adds the
  next ones into it (10 each, the last too); the reduce-scatter's copy-in (``chunk_cat`` into
  an fp32 buffer) reads that fp32 sum (8), or the bf16 gradient itself at m = 1 (6): full
  6 + 10(m-1) + 8 (m > 1), 6 (m = 1); fp32 12(m-1) + 8. The division is NCCL's AVG (no kernel).
  Each all-gather copies the rank's fp32 shard into its input in bf16 (``_foreach_copy_``: 6,
  fp32 8) and out of its output into the unsharded parameters (``split_with_sizes_copy``: 2 + 2,
  fp32 8): per gather, shard 6 and full 4 (8 and 8). Gathers: forward and backward of every
  microbatch (2m) without a pipeline, once per step per stage with one (the planner's pipelined
  ZeRO-3 keeps the stage gathered). Clipping (``clip_grad_norm_dtensor``): 12 + 8; A fused
  (every parameter a DTensor); no copy back: the fp32 shard is the master and its bf16 copy is
  made by the next all-gather (counted above).
* **Megatron-LM** (``--bf16``, distributed optimizer at dp_shard > 1; its ``DistributedOptimizer``
  and ``clip_grads.py``). ``--gradient-accumulation-fusion`` makes the weight-gradient GEMMs
  accumulate straight into the fp32 ``main_grad`` buffer: no fold kernel (the GEMM's epilogue
  reads and writes C, inside the GEMM's compute-bound time, not priced); the buffer is zeroed
  each step (``zero_grad_buffer``: 4 per element of the full buffer). The reduced fp32 shard
  becomes the main parameter's gradient without a copy (``.float()`` of fp32 is itself); the
  norm is ``multi_tensor_l2norm`` (4), the scale ``multi_tensor_scale`` (8, Megatron skips it
  when the factor is not below 1: counted as clipping on, an upper bound); fused Adam (28);
  ``_copy_main_params_to_model_params`` rounds the fp32 shard into the bf16 parameter buffer
  (4 + 2). Full 4; shard 12 + 28 + 6. fp32 (no ``--bf16``): no copy back.
* **torchtitan** (FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, its
  default ``mixed_precision_param``; ``clip_grad_norm_`` with foreach; AdamW
  ``implementation = "fused"``, its default). At ZeRO-3: Loom's FSDP2 counts (gradients
  accumulated unsharded across microbatches, as the memory model holds them), but its clipping
  norm is one read (torch's ``_foreach_norm``): 4 + 8. Its ZeRO-1/2 layouts are FSDP2 too,
  with ``reshard_after_forward = False`` (one gather per step, the caller's ``gathers``).
  Without FSDP (DDP, one rank) torchtitan trains fp32 parameters under autocast: Loom's fp32
  counts with a foreach-norm clip.
* **DeepSpeed** (ZeRO with bf16 and fp32 gradient accumulation, as Megatron-DeepSpeed ran
  BLOOM; an assumption from its design, not a line count): no accumulation fusion. ZeRO-0/1:
  each microbatch's bf16 gradient is added into the full fp32 accumulation buffer (10), zeroed
  each step (4): full 10m + 4. ZeRO-2/3 reduce every microbatch: the bf16 gradient is copied
  into a reduction bucket (2 + 2: full 4m) and the reduced partition added into the zeroed fp32
  partition (shard 10m + 4). Shard, besides: norm 4, scale 8, fused Adam 28, the fp32
  partition rounded into the bf16 parameters 6.

What the flat count before this module (28 bytes per stepped parameter, the fused step alone)
left out is the rest of each line: for Loom's one-rank bf16 at m = 2, 62 bytes instead of 28.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSED_ADAMW = 28  # p, g, m, v read; p, m, v written; fp32
FOREACH_ADAMW = 80  # torch's foreach (and single-tensor) AdamW: eight passes (see docstring)
NORM_READ = 4  # one read per gradient element (foreach norm, multi_tensor_l2norm)
NORM_SQUARED = 12  # g.pow(2) into a temporary, then its sum
SCALE = 8  # the clipping factor's in-place multiply
STACKS = ("loom", "megatron", "torchtitan", "deepspeed")


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one rank's gradient handling and optimizer step move per step: ``full`` per
    parameter it holds whole, ``shard`` per parameter it steps (its ZeRO slice, or what it
    holds without ZeRO)."""

    full: float
    shard: float

    def bytes(self, held: float, stepped: float) -> float:
        """Bytes of a rank holding ``held`` parameters and stepping ``stepped`` of them."""
        return self.full * held + self.shard * stepped


def _accumulated(m: int, master: bool) -> int:
    """Gradient accumulation without a preset buffer: the bf16 fold (6, then 10 each) or
    autograd's in-place fp32 add after the first microbatch (12 each)."""
    return 6 + 10 * (m - 1) if master else 12 * (m - 1)


def _fsdp2(m: int, master: bool, gathers: int, norm: int, clip: bool) -> StepTraffic:
    """FSDP2's unsharded accumulation, copy-ins and copy-outs, and a fused step (docstring)."""
    if master:
        full = 6 + 10 * (m - 1) + 8 if m > 1 else 6
        gather_shard, gather_full = 6, 4
    else:
        full, gather_shard, gather_full = 12 * (m - 1) + 8, 8, 8
    return StepTraffic(full + gathers * gather_full,
                       gathers * gather_shard + norm + SCALE * clip + FUSED_ADAMW)


def step_traffic(stack: str, *, microbatches: int, master: bool, zero_stage: int = 0,
                 gathers: int = 0, clip: bool = True, fused: bool = True) -> StepTraffic:
    """Per-parameter bytes of ``stack``'s gradient handling and AdamW step (the module
    docstring's counts). ``master``: bf16 parameters with fp32 masters; ``zero_stage``: the
    stage in effect (0 when the shard group is one rank); ``gathers``: FSDP2's all-gathers
    of each parameter per step (Loom's ZeRO-3, torchtitan's every sharded stage); ``clip``:
    gradients scaled by the clipping factor (``train.grad_clip`` > 0); ``fused``: Loom's AdamW
    is the fused kernel (other stacks' always are)."""
    m = microbatches
    if m < 1:
        raise ValueError(f"microbatches {m}: at least 1")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage}: 0, 1, 2 or 3")
    scale = SCALE if clip else 0
    if stack == "loom":
        adam = FUSED_ADAMW if fused else FOREACH_ADAMW
        if zero_stage == 0:
            return StepTraffic(_accumulated(m, master),
                               NORM_READ + scale + adam + (6 if master else 0))
        if zero_stage == 3:
            return _fsdp2(m, master, gathers, NORM_SQUARED, clip)
        full = (10 * m if master else 12 * m) + 4 if zero_stage == 1 \
            else _accumulated(m, master) + 12
        return StepTraffic(full, 16 + NORM_SQUARED + scale + FUSED_ADAMW + (6 if master else 8))
    if stack == "megatron":
        return StepTraffic(4, NORM_READ + scale + FUSED_ADAMW + (6 if master else 0))
    if stack == "torchtitan":
        if zero_stage:
            return _fsdp2(m, master, gathers, NORM_READ, clip)
        return StepTraffic(_accumulated(m, False), NORM_READ + scale + FUSED_ADAMW)
    if stack == "deepspeed":
        step = NORM_READ + scale + FUSED_ADAMW + (6 if master else 0)
        if zero_stage >= 2:
            return StepTraffic(4 * m, 10 * m + 4 + step)
        return StepTraffic(10 * m + 4, step)
    raise ValueError(f"stack {stack!r}: one of {', '.join(STACKS)}")


__all__ = ["StepTraffic", "step_traffic", "FUSED_ADAMW", "FOREACH_ADAMW", "STACKS"]
