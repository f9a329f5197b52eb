"""Which training stack the planner prices: memory layout and overlap defaults per framework.

``loom plan --framework loom|megatron|torchtitan|deepspeed|scaling`` picks one ``Framework``.
The cost model reads from it what differs between the stacks at the same layout; everything
else (the FLOPs, the alpha-beta links, the schedules) is shared. Loom's own profile follows
Loom's trainer and is what the cost model always priced; the others let a user plan for their
stack and let Loom's model be checked against runs published on those stacks.

What a profile fixes:

* **Model state bytes per parameter**: the copy the GEMMs read (``param_bytes``), the gradient
  (``grad_bytes``, also the dtype of the gradient reduction), and the optimizer's state
  (``optimizer_bytes``: an fp32 master copy where the parameters are 16-bit, plus AdamW's two
  fp32 moments). ZeRO stage 1 shards the optimizer state, 2 also the gradients, 3 also the
  parameters, over dp_shard x cp (Megatron's distributed optimizer is stage 1).
  - Loom: the planner's model of Loom's trainer (``loom.formulas.memory.model_state_bytes``):
    fp32 parameters and gradients, two moments, 4 + 4 + 8, or under ``train.dtype = bf16``
    (what the planner's configs train: the cost model's 2-byte ``dtype_bytes``) bf16
    parameters with fp32 masters. Loom's memory path uses those formulas, not this profile's
    byte fields; its ``grad_bytes`` (``train.grad_reduce_dtype``'s default fp32) and
    ``zero12_gather_bytes`` price its collectives, the latter 0: ZeRO-1/2 all-gather the
    updated slices in the parameters' own dtype (``loom.parallel.zero``: bf16 under
    ``train.dtype = bf16``), ``CostModel.zero12_gather_bytes``.
  - Megatron-LM (``--bf16``, gradients accumulated and reduced in fp32, the default with bf16):
    bf16 parameters, fp32 ``main_grad``, fp32 master + moments: 2 + 4 + 12, i.e. the "6 + 12/d"
    bytes of its distributed optimizer.
  - torchtitan (FSDP2, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): fp32
    sharded parameters, fp32 gradients, two moments: 4 + 4 + 8, as Loom.
  - DeepSpeed (ZeRO with bf16, as Megatron-DeepSpeed ran BLOOM): bf16 parameters, fp32 gradient
    accumulation, fp32 master + moments: 2 + 4 + 12. An assumption: DeepSpeed's fp16 path
    (ZeRO paper: 2 + 2 + 12) keeps 16-bit gradients instead.
* **Activations**: Loom's profile is its trainer's own formula
  (``loom.formulas.memory.block_activation_bytes``, whatever Loom's sequence parallelism saves).
  torchtitan's is the same block with the all-gathered inputs of the column-parallel linears
  saved whole (``sp_keeps_gathered``: DTensor's sequence parallelism saves the gathered input,
  as Loom's compiled block does). Megatron's sequence parallelism shards every activation of a
  block (Korthikanti et al. 2022: 34·s·b·h/t for a GPT block with dropout, 5·a·s²·b/t more
  without a flash kernel; ``korthikanti_block_activation_bytes``), and so does DeepSpeed's
  (Megatron-DeepSpeed's blocks); ``flash_attention`` (a flash ``attention_kernel``) says whether
  the attention core stores the s x s probabilities, ``dropout`` whether the block keeps 1-byte
  dropout masks (GPT-style).
* **What "selective" recomputation means** (``selective``): ``"core"``, Korthikanti et al.
  2022's, the attention core recomputed (Megatron-LM, DeepSpeed, Loom's trainer); ``"ops"``,
  torchtitan's op-level selective checkpointing (``selective_ac_option = "op"``): each block
  keeps the outputs of its matmuls, its attention and its reductions, except every second
  matmul (``# Saves output of all compute ops, except every second mm``, its
  ``_apply_ac_to_transformer_block``), and recomputes everything else in backward
  (``loom.formulas.memory.op_sac_block_bytes``; the recomputed matmuls are a Llama block's
  wk, wo and w3, the 2nd, 4th and 6th it runs).
* **How the routed experts run** (MoE): ``grouped_experts``, one grouped GEMM per expert
  matrix for all of a rank's experts (Megatron's ``--moe-grouped-gemm``, on in its MoE
  recipes; torchtitan's ``GroupedExperts``), or a loop with each expert's GEMMs its own
  kernels (Loom's trainer, whose CPU path has no grouped GEMM; DeepSpeed-MoE's local experts);
  ``fp8_experts``, whether FP8 training converts the routed experts' GEMMs (Megatron: TE's
  ``GroupedLinear`` runs in FP8 under ``--fp8-format``) or leaves them in bf16 (Loom's
  ``loom.parallel.fp8`` converts only ``nn.Linear``; torchtitan's float8 for MoE is an
  opt-in prototype). Either way each expert's GEMM has only its share of the rows
  (``loom.sim.expert_cost``), which sets its efficiency.
* **Memory beyond the block** (Aleph Alpha's Scaling, the stack of Hagemann et al. 2023's
  layout sweep, ``bench/planner_sweep.py``; read from its public code, github.com/Aleph-Alpha/
  scaling, the 2024 release of the "AA-Scaling" codebase the paper ran):
  - model state: bf16 parameters and gradients (autograd accumulates into the bf16
    parameters' ``.grad``, on every data-parallel rank: "each data-parallel worker will still
    have all original-precision weights as well as gradients"), fp32 master + two moments
    sharded over data parallelism with ``zero`` (its ZeRO-1): 2 + 2 + 12/d; foreach AdamW's
    temporaries (``torch.optim.AdamW``'s default on CUDA);
  - after the backward the gradients are all-reduced in buckets of 5·10^8 elements, each
    flattened and copied to fp32 (``bucket_allreduce``: ``bucket_allreduce_bytes``), then the
    step frees the gradients it does not own and copies its own slice to fp32
    (``fp32_grad_slice``: 4 bytes per stepped parameter beside its 2-byte gradients);
  - the attention core without flash is PyTorch ops: a dense boolean mask saved by
    ``masked_fill_``, the softmax (``softmax_in_fp32``: upcast, its fp32 output saved beside
    the bf16 copy the matmul saves; ``unfused_scores_bytes``). An assumption: the sweep's
    "fused" kernel is Megatron's scale-mask-softmax (its bf16 output only), a kernel the public
    release no longer has;
  - RMSNorm without the kernel is Llama's reference code, ``_norm(x.float()).type_as(x) *
    weight`` with ``_norm(x) = x * rsqrt(mean(x^2) + eps)`` (``core/nn/norm/rms_norm.py`` in
    the release's first public commit, 7848929, Aug 2024; Oct 2024's squares the bf16 input
    and upcasts after): it saves the fp32 copy of its input and its bf16 output, not its input
    (``norm_saves_output``); the sweep's "+ RMS kernel" cells ran the alternative that
    version has, flash-attn's fused ``rms_norm`` (``fused_norm``);
  - the block is eager PyTorch in Megatron's [s, b, h] layout (``eager_copies``): SwiGLU's
    ``silu(x) * gate`` saves ``silu(x)``, and flash attention's output is rearranged from
    [b·s, heads, d] back for the output projection, which saves that copy beside the kernel's;
  - the head all-gathers its logits (``ColumnParallelLinear(parallel_output=False)``) and the
    loss upcasts them whole to fp32: log-probabilities, the logits and the loss's backward on
    the whole vocabulary on every tensor-parallel rank (``gathered_logits``:
    ``gathered_logits_bytes``);
  - its pipeline schedule (``PipelineScheduleTrain``, DeepSpeed's) holds p microbatches on
    the first stage, as 1F1B;
  - ``allocator_reserve``: what PyTorch's caching allocator holds in fragments it cannot hand
    out, as a share of the device's memory, so that a layout fits when its bytes are within
    (1 - reserve) of it. 0.15: GMLake (Guo et al., ASPLOS 2024) measured the caching
    allocator's fragmentation over eight LLMs' training on A100-80GB at 15% on average (up to
    33%). A property of the allocator, not of Scaling: the other profiles keep 0 (their
    published comparisons were made without it); ``loom.plan.search.plan`` budgets the
    smaller of its memory fraction (0.9) and 1 - reserve.
* **Attention kernel** (``attention_kernel``, its time; ``loom.sim.cost_model``): a flash kernel
  skips the causal half of the square, FlashAttention (v1) at half FlashAttention-2's rate
  (Dao 2023: "around 2x" faster); the others compute the whole square with two batched matmuls
  and move the s x s scores through memory, ``fused`` in one softmax kernel, ``unfused`` through
  separate scale, mask and softmax kernels. Loom, Megatron-LM and torchtitan run flash kernels
  today; the DeepSpeed profile (Megatron-DeepSpeed as BLOOM ran it) the fused softmax.
  ``fused_norm``: each RMSNorm runs as one kernel each way (a norm kernel, or the compiler's
  fusion). In a compiled stack, false prices the norms as eager fp32 ops beside its other
  fused kernels (Megatron without Apex's or TE's norm); in an eager one (``compiled`` false),
  true leaves the norms' eager ops out of ``loom.sim.eager_cost``'s traffic. Loom's trainer
  and torchtitan run their norms as eager ops unless compiled (Loom's ``_RMSNormFunction``,
  torchtitan's ``nn.RMSNorm``); Scaling's public release too (Llama's reference norm; the
  sweep's "+ RMS kernel" cells ran flash-attn's fused RMSNorm). ``compiled_as`` sets both:
  compiling fuses the norms.
* **Eager or compiled** (``compiled``): whether the block's element-wise chains (norms,
  residual adds, RoPE, SwiGLU) run fused, as ``torch.compile``'s inductor or hand-fused kernels
  run them, or as one eager kernel per op; ``loom.sim.eager_cost`` counts what eager moves
  beyond fused, from Loom's block. Loom: false, as ``train.compile`` defaults (the plan follows
  ``loom plan --compile``; ``bench/gpu.py`` the run's ``train.compile``). torchtitan: false,
  its configs' default (``compile.enable``) and what its published BF16 rows ran (its 8B FSDP
  row: "no torch.compile"; the compiled ones are its Float8 rows). Megatron-LM: true, its
  fused RMSNorm / LayerNorm (Apex or Transformer Engine), fused RoPE and bias-SwiGLU / GELU
  kernels do what the compiler's fusion does. DeepSpeed (Megatron-DeepSpeed): true, the same
  fused norm, bias-GELU and scale-mask-softmax kernels.
* **Overlap** (``Overlap``, priced by ``loom.sim.streams``): TP communication pipelined with the
  GEMMs (Megatron's ``--tp-comm-overlap``, which needs sequence parallelism), the ZeRO-1/2
  parameter all-gather overlapped with the next forward (``--overlap-param-gather``, in the
  parameters' dtype), how much of the step hides the gradient reduction (``"none"``: after the
  backward; ``"last_backward"``: the last microbatch's backward of the rank; ``"pipeline_flush"``:
  that and the pipeline's drain after it, Megatron's ``--overlap-grad-reduce``), and ZeRO-3's
  prefetch of the next layer's parameters (FSDP2, DeepSpeed ZeRO-3's prefetch).
  Megatron's TP-comm overlap is Transformer Engine's userbuffers, whose defaults
  (``transformer_engine/pytorch/module/base.py``, ``initialize_ub``) overlap the all-gathers
  by ring exchange on the copy engines (one SM), but run the reduce-scatter behind the
  row-parallel forward GEMMs (out-projection, fc2: "pipeline") and the bulk overlaps beside
  the column-parallel backward GEMMs (qkv and fc1 dgrad and wgrad: "bulk") on 16 SMs each,
  launching those GEMMs with a 16-SM margin (``tp_overlap_sms``): on an H100's 132 SMs they
  run 132/116 times longer (``Gpu.sms``; ``loom.sim.tp_overlap_cost``).
* **Gradient handling and optimizer step** (``step_path``): whose code path the step's HBM
  traffic follows (gradient accumulation, clipping, AdamW, masters rounded back);
  ``loom.sim.optimizer_cost`` counts each stack's bytes.
* **Rank order** (``rank_order``, innermost first): which ranks a group of each parallelism
  spans, and so which link and how much of a rack's or pod's uplinks it uses
  (``loom.plan.hardware.Cluster.link_for``). Loom, Megatron-LM (``tp-cp-ep-dp-pp``) and
  torchtitan (``pp, dp_replicate, dp_shard, cp, tp`` outermost first) all put the pipeline
  outermost; a published run may state another (Llama 3: "[TP, CP, PP, DP]", data parallelism
  outermost), which its row overrides.

Torch-free and communicates nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from loom.sim.optimizer_cost import STACKS

GRAD_REDUCE = ("none", "last_backward", "pipeline_flush")
# What selective recomputation recomputes (``Framework.selective``): the attention core
# (Korthikanti et al. 2022), or torchtitan's op-level policy
SELECTIVE = ("core", "ops")
# How a stack runs the attention core (``Framework.attention_kernel``; the cost model prices each,
# ``loom.sim.cost_model``): FlashAttention-2, FlashAttention (v1), or the s x s scores stored
# and read back around a softmax, fused into one kernel (Megatron's scale-mask-softmax) or not
ATTENTION_KERNELS = ("flash2", "flash1", "fused", "unfused")
# Loom's rank grid, innermost (fastest-varying) axis first: loom.topology.AXES reversed
RANK_ORDER = ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")
# The groups whose rank distance the cost model asks for (``Framework.group_strides``)
GROUPS = {"cp": ("cp",), "ep": ("ep",), "pp": ("pp",), "shard": ("dp_shard", "cp", "ep"),
          "rep": ("dp_replicate",), "dp": ("dp_replicate", "dp_shard", "cp", "ep")}


@dataclass(frozen=True)
class Overlap:
    """What each collective hides behind (see the module docstring)."""

    tp_comm: bool = False
    param_gather: bool = False
    grad_reduce: str = "last_backward"
    zero3_prefetch: bool = True

    def __post_init__(self) -> None:
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce {self.grad_reduce!r}: one of {', '.join(GRAD_REDUCE)}")


@dataclass(frozen=True)
class Framework:
    """One training stack's memory layout and overlap defaults."""

    name: str
    param_bytes: int  # the copy the GEMMs read (fp32 in Loom: autocast casts per use)
    grad_bytes: int  # gradients held and reduced
    optimizer_bytes: int  # fp32 master copy (where params are 16-bit) + AdamW's two moments
    # ZeRO-1/2's parameter all-gather after the step, per element (0: the parameters' dtype)
    zero12_gather_bytes: int
    sp_shards_all: bool  # sequence parallelism shards every activation (Megatron)
    attention_kernel: str = "flash2"  # ATTENTION_KERNELS: how the attention core runs
    fused_norm: bool = True  # one kernel per RMSNorm each way (a norm kernel or the compiler's)
    compiled: bool = True  # element-wise chains fused (else one kernel per op; eager_cost)
    dropout: bool = False  # 1-byte dropout masks kept (GPT-style blocks)
    optimizer_temporaries: bool = False  # foreach AdamW's two state-sized temporaries
    sp_keeps_gathered: bool = False  # Loom's block, SP saving the gathered inputs whole
    # what Aleph Alpha's Scaling holds beyond a Megatron-style block (see "Memory beyond the
    # block" in the module docstring); all false elsewhere
    softmax_in_fp32: bool = False  # the written-out core's softmax in fp32 (unfused_scores_bytes)
    norm_saves_output: bool = False  # an eager RMSNorm saves its fp32 input copy and its output
    # an eager block: SwiGLU's silu(x), the flash output's reshaped copy, and a written-out
    # core's mask and probabilities (unfused_scores_bytes)
    eager_copies: bool = False
    gathered_logits: bool = False  # logits all-gathered over tp, the loss on the whole vocabulary
    bucket_allreduce: bool = False  # 16-bit gradients all-reduced in fp32 buckets after backward
    fp32_grad_slice: bool = False  # the ZeRO-1 step copies its own gradients' slice to fp32
    # the share of device memory the caching allocator holds but cannot hand out (fragments)
    allocator_reserve: float = 0.0
    # the ZeRO stages the stack has (the planner's search proposes no other): Scaling has
    # only its optimizer sharding (stage 1); the others keep every stage (Megatron's
    # distributed optimizer and Megatron-FSDP, FSDP2 with and without resharding, DeepSpeed)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # whose gradient handling and optimizer step the step's HBM traffic follows
    # (``loom.sim.optimizer_cost.STACKS``)
    step_path: str = "loom"
    overlap: Overlap = field(default_factory=Overlap)
    rank_order: tuple[str, ...] = RANK_ORDER  # innermost first
    selective: str = "core"  # SELECTIVE: what selective recomputation recomputes
    # the routed experts: one grouped GEMM per matrix for all local experts (else a loop of
    # per-expert GEMMs, each its own kernels), and whether FP8 converts them too
    grouped_experts: bool = False
    fp8_experts: bool = False
    # SMs the stack's TP-comm overlap gives its communication kernels beside the GEMMs it runs
    # with an SM margin (0: none; see "Overlap" in the module docstring)
    tp_overlap_sms: int = 0

    def __post_init__(self) -> None:
        if self.selective not in SELECTIVE:
            raise ValueError(f"selective {self.selective!r}: one of {', '.join(SELECTIVE)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel {self.attention_kernel!r}: one of"
                             f" {', '.join(ATTENTION_KERNELS)}")
        if not 0.0 <= self.allocator_reserve < 1.0:
            raise ValueError(f"allocator_reserve {self.allocator_reserve}: a share in [0, 1)")
        if self.step_path not in STACKS:
            raise ValueError(f"step_path {self.step_path!r}: one of {', '.join(STACKS)}")
        if sorted(self.rank_order) != sorted(RANK_ORDER):
            raise ValueError(f"rank_order {list(self.rank_order)}: an ordering of"
                             f" {', '.join(RANK_ORDER)} (innermost first)")

    @property
    def is_loom(self) -> bool:
        return self.name == "loom"

    @property
    def flash_attention(self) -> bool:
        """Whether the attention core is a flash kernel (the s x s scores never stored)."""
        return self.attention_kernel.startswith("flash")

    def stride(self, degrees: Mapping[str, int] | tuple[int, ...], *axes: str) -> int:
        """The rank distance ``Cluster.link_for`` takes for a group along ``axes``: the ranks
        such a group spans (the product of the degrees of every axis up to its outermost one in
        ``rank_order``) over its size; a group along one axis gets the product of the axes
        inside it. ``degrees``: each axis's degree, by name or as a tuple in ``RANK_ORDER``
        (the cost model's form: the search asks this for every layout, so it is cached)."""
        if not isinstance(degrees, tuple):
            degrees = tuple(degrees.get(a, 1) for a in RANK_ORDER)
        return _stride(self.rank_order, degrees, axes)

    def group_strides(self, degrees: tuple[int, ...]) -> dict[str, int]:
        """``stride`` of every group of ``GROUPS`` (degrees in ``RANK_ORDER``), cached per
        grid: the search prices many layouts of one grid. Shared: do not change it."""
        return _group_strides(self.rank_order, degrees)

    def compiled_as(self, compiled: bool) -> "Framework":
        """This stack under ``torch.compile`` (``compiled``) or eager: compiling fuses each
        norm's ops into one kernel too, so a compiled stack's norms are fused; eager, they are
        what the registered profile of this name runs (this one's own if it has none)."""
        if compiled:
            return replace(self, compiled=True, fused_norm=True)
        own = FRAMEWORKS.get(self.name, self)
        return replace(self, compiled=False, fused_norm=own.fused_norm)

    def with_overlap(self, **changes: object) -> "Framework":
        """This profile with some overlap knobs changed (a published run's own settings)."""
        return replace(self, overlap=replace(self.overlap, **changes))


@functools.lru_cache(maxsize=16384)
def _group_strides(order: tuple[str, ...], degrees: tuple[int, ...]) -> dict[str, int]:
    return {name: _stride(order, degrees, axes) for name, axes in GROUPS.items()}


@functools.lru_cache(maxsize=16384)
def _stride(order: tuple[str, ...], degrees: tuple[int, ...], axes: tuple[str, ...]) -> int:
    """``Framework.stride`` for ``degrees`` given in ``RANK_ORDER``."""
    degree = dict(zip(RANK_ORDER, degrees))
    active = [a for a in axes if degree[a] > 1]
    if not active:
        return 1
    outer = max(order.index(a) for a in active)
    return math.prod(degree[a] for a in order[:outer + 1]) // math.prod(degree[a] for a in active)


FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    Framework("loom", param_bytes=4, grad_bytes=4, optimizer_bytes=8, zero12_gather_bytes=0,
              sp_shards_all=False,  # its step: cost_memory's fused_step rule, per layout
              compiled=False,  # train.compile's default
              fused_norm=False,  # _RMSNormFunction's eager ops (fused when compiled)
              overlap=Overlap(tp_comm=False, param_gather=False, grad_reduce="last_backward")),
    Framework("megatron", param_bytes=2, grad_bytes=4, optimizer_bytes=12, zero12_gather_bytes=2,
              sp_shards_all=True, dropout=True, step_path="megatron",
              grouped_experts=True, fp8_experts=True,  # --moe-grouped-gemm, TE's FP8 GroupedLinear
              tp_overlap_sms=16,  # TE userbuffers' "pipeline" and "bulk" defaults
              overlap=Overlap(tp_comm=True, param_gather=True, grad_reduce="pipeline_flush")),
    Framework("torchtitan", param_bytes=4, grad_bytes=4, optimizer_bytes=8, zero12_gather_bytes=2,
              sp_shards_all=False, sp_keeps_gathered=True,  # fused AdamW by default
              compiled=False,  # compile.enable's default; its published BF16 rows ran eager
              fused_norm=False,  # nn.RMSNorm's eager ops (fused when compiled)
              step_path="torchtitan", selective="ops",
              grouped_experts=True,  # its MoE's GroupedExperts (torch._grouped_mm)
              overlap=Overlap(tp_comm=False, param_gather=False, grad_reduce="last_backward")),
    Framework("deepspeed", param_bytes=2, grad_bytes=4, optimizer_bytes=12, zero12_gather_bytes=2,
              sp_shards_all=True, attention_kernel="fused", dropout=True, step_path="deepspeed",
              overlap=Overlap(tp_comm=False, param_gather=False, grad_reduce="last_backward")),
    # Aleph Alpha's Scaling (github.com/Aleph-Alpha/scaling, core/optimizer, core/nn,
    # transformer/model): bf16 parameters with their bf16 gradients on every data-parallel
    # rank, fp32 master + moments (ZeRO-1 shards them), eager PyTorch blocks, the gradients
    # all-reduced after the backward
    Framework("scaling", param_bytes=2, grad_bytes=2, optimizer_bytes=12, zero12_gather_bytes=2,
              sp_shards_all=True, compiled=False, fused_norm=False, optimizer_temporaries=True,
              softmax_in_fp32=True, norm_saves_output=True, eager_copies=True,
              gathered_logits=True, bucket_allreduce=True, fp32_grad_slice=True,
              allocator_reserve=0.15, zero_stages=(0, 1), step_path="megatron",
              overlap=Overlap(tp_comm=False, param_gather=False, grad_reduce="none")),
)}
LOOM = FRAMEWORKS["loom"]


def framework(name: str) -> Framework:
    """The profile called ``name``; ValueError naming the choices otherwise."""
    if name not in FRAMEWORKS:
        raise ValueError(f"--framework {name}: one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


__all__ = ["Framework", "Overlap", "FRAMEWORKS", "LOOM", "framework", "GRAD_REDUCE",
           "RANK_ORDER", "GROUPS"]
