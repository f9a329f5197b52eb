"""The planner's cost model: time, memory and FLOPs of one training step under a layout.

``CostModel(model, seq_len, global_batch, cluster).evaluate(layout)`` prices one step of Loom's
runtime on a cluster: per-stage F / I / W durations (``StageCosts``, what ``loom.schedule.simulate``
replays, so the pipeline part of the step is the simulator's, not a formula's), the exposed
communication around it, the optimizer step, and the bytes every rank holds (``cost_memory``);
which layers and parameters each rank holds is ``loom.sim.rank_params``'s (``CostModel.ranks``).
Its stage costs are ``loom.schedule.cost``'s container, so that the planner and the simulator
share one notion of cost. It communicates nothing.

Compute (per layer, per microbatch, on one rank; T = b·s/cp tokens, h dim, a / k query / KV
heads of width d, f FFN width, t = tp; a matmul of m x k by k x n is 2mkn FLOPs):

* projections 2T·h·d·(2a + 2k)/t, SwiGLU MLP 6T·h·f/t (GELU: 4T·h·f/t), attention core
  4T·s·a·d/t halved for a causal mask (the work a mask-skipping kernel does; MFU below counts
  the full square, as PaLM and TorchTitan do), or under a sliding window W (Mistral's) the
  pairs inside it, 4T·a·d·(W - W(W-1)/2s)/t (``formulas.flops.attended_keys``; flash kernels
  skip the blocks past the window, so does Loom's ring), with the stack's flash kernel
  (FlashAttention v1 at half v2's rate); a kernel that stores the s x s scores
  (``Framework.attention_kernel`` fused or unfused) computes the whole square and moves the
  scores through memory
  (``SCORE_PASSES`` e-byte passes each way, at the HBM bandwidth); a compiled stack without a
  fused RMSNorm (``Framework.fused_norm``) moves ``UNFUSED_NORM_BYTES`` more per element; an MoE
  layer replaces the MLP by a router 2T·h·E and top_k routed plus n_shared experts of width
  f_e, each of the dense MLP's kind: 2c·T·h·f_e·(top_k + n_shared)/t (c = 3 SwiGLU, 2 GELU);
* backward after Zero Bubble (Qi et al. 2024, Table 1): I = the matmuls again plus the
  attention core's backward (2.5x its forward under a flash kernel, which recomputes the
  scores; 2x under one that stores them: ``CostModel.core_backward``), W = the matmuls again
  (in high precision, uncast, under FP8's ``rowwise_with_gw_hp``: ``loom.sim.fp8_cost``);
  recomputation adds to I what its policy runs again (``loom.sim.recompute_cost``: full F,
  every_k its share of F, selective the core or torchtitan's op-level part);
* matmul time = FLOPs / ``Gpu.matmul_rate(smallest dim)``, a routed expert's GEMMs at its
  share of the rows, T·top_k·ep/E under balanced routing (a rank's E/ep experts take the
  assignments of every ep rank), in FP8 where the stack converts them
  (``Framework.fp8_experts``), one kernel for all local experts where it groups them
  (``Framework.grouped_experts``, ``loom.sim.launch_cost``), and the tokens' moves into
  expert order and back at the HBM bandwidth (``loom.sim.expert_cost``); element-wise work
  (norms, residuals, RoPE, SwiGLU) is memory-bound: about 20 reads or writes of T·h elements
  per layer forward (8 replicated and 12 split by tp, all split under sequence parallelism),
  twice that backward, at the HBM bandwidth (what fused kernels move: a compiled block); an
  eager one (``Framework.compiled`` false) moves ``loom.sim.eager_cost``'s bytes more, each op
  its own kernel; plus a fixed ``op_overhead`` per layer pass (a CPU profile's measured block cost);
  a pass takes at least its kernels' host launch time (``loom.sim.launch_cost``: eager or
  compiled kernel counts times ``Gpu.launch_overhead``), the host queuing ahead of the device.

Communication, alpha-beta per link class (``Cluster.link_for``: a group inside one node uses the
intra-node link, otherwise the inter-node one, its bandwidth divided by the rack's (and the
spine's) oversubscription when the group spans racks (pods); n ranks, M bytes, beta = effective
bandwidth): ring all-reduce 2(n-1)/n·M/beta + 2(n-1)·alpha, tree all-reduce 2·M/beta +
2·log2(n)·alpha (the cheaper is used, as NCCL picks), all-gather / reduce-scatter
(n-1)/n·M/beta + (n-1)·alpha, all-to-all (n-1)/n·M/beta + (n-1)·alpha, point-to-point alpha +
M/beta (``loom.sim.collectives``). What overlaps follows
Loom's runtime:

* tp: two all-reduces of T·h·e forward and two backward per layer (all-gather + reduce-scatter
  pairs under SP, the same time), not overlapped in Loom's profile; a profile with TP-comm
  overlap (Megatron's, with SP) pipelines them with the layer's GEMMs in tp chunks
  (``streams.chunked_overlap``), each GEMM chunk of 1/tp of the rows at that narrower
  shape's efficiency, and the GEMMs Transformer Engine runs beside its 16-SM communication
  kernels (forward row-parallel, backward column-parallel) on the SMs left
  (``loom.sim.tp_overlap_cost``); a fully recomputed layer repeats the forward's;
* cp ring: cp-1 steps passing K and V (2T·k·d·e/t bytes), overlapped with the attention block
  of the step (exposed only beyond it), twice the bytes in backward; Ulysses: all-to-alls of q,
  k, v and the output forward, the same backward, not overlapped; hybrid: both, at their degrees;
* ep: dispatch and combine all-to-alls of T·top_k·h·e forward, the same backward, per MoE layer
  (an all-to-all spanning nodes, ep's or Ulysses', sends its intra-node share over the node's
  link and the rest over the NICs at once: ``collectives.spanning_all_to_all_time``);
* pp: one activation of T·h·e (T·h·e/t under SP) per stage boundary, as the simulator's send;
  vocabulary parallelism across the pipeline (``Layout.vocab_parallel_pp``) is in ``vocab_cost``;
* data parallelism (group dp_replicate·dp_shard·ep·cp, gradients in ``grad_bytes`` per element):
  all-reduce; ZeRO-1/2 reduce-scatter + all-gather of parameters (the same 2Ψ); ZeRO-3 all-gathers
  the parameters of each layer forward and backward, per microbatch without a pipeline and once
  per step per stage with one, prefetched so only what exceeds the layer's compute is exposed,
  plus one reduce-scatter, all over dp_shard·cp (the cp ranks hold the same weights), the FP8
  linears' weights at 1 byte under FSDP2's float8 all-gather (``fp8_all_gather``); HSDP adds
  an all-reduce of 1/(dp_shard·cp) over dp_replicate (``loom.sim.dp_cost``). Each of these is
  cut into one piece per layer and queued on its link's stream behind the layer passes it overlaps
  (``loom.sim.streams``: collectives sharing a link take their sum there, on two links the max):
  the reduction behind the last microbatch's backward of the rank (or, per the framework
  profile, not at all, or across the pipeline flush), ZeRO-3's gathers ahead of each layer of
  the forward and backward, ZeRO-1/2's parameter all-gather after the step (exposed) or behind
  the next forward (Megatron's, in bf16); only what the links carry past the compute is exposed;
* optimizer: the gradient handling and AdamW step of the framework's code path at HBM
  bandwidth (``loom.sim.optimizer_cost``: bytes per parameter the rank holds and per parameter
  it steps, by microbatches, dtype, ZeRO stage, clipping and fused or foreach AdamW; Loom's
  profile is bf16 parameters with fp32 masters at ``dtype_bytes`` 2, fp32 otherwise); a CPU
  profile measures its AdamW step's seconds per parameter instead (``Gpu.optimizer_per_param``).

A CPU profile (``loom plan --calibrate``) adds three things an accelerator does not have: ranks
that share fewer cores (``Gpu.cores``: compute slows by ranks / cores when every rank computes;
a pipeline's simulation shares the cores among the ranks busy at each instant instead), no
overlap of communication with compute on such shared cores (``overlaps``), and the
framework work of each parallel wrapper (``Gpu.framework``, per layer pass and per step, charged
for the wrappers a layout uses: ``wrappers``).

Screening (``loom.sim.pipeline_estimate``): hundreds of thousands of layouts are priced, only the
finalists simulated; before that the pipelined part is the busiest rank's work per microbatch
times m, plus the family's warm-up and cool-down as (p - 1) rank passes scaled by its published
bubble (REFERENCE.md §1.1, §5.2), plus the stage-boundary hops; ``search_costs`` gives the
relative per-rank costs a searched schedule is searched for.

What differs between training stacks (bytes per parameter, gradients and optimizer state; what
sequence parallelism shards; the attention kernel; the overlap defaults) comes from the
``framework`` profile (``loom.sim.frameworks``; Loom's own by default).

Memory is ``loom.formulas.memory``'s formulas (the estimator ``loom estimate-memory`` uses, measured
to within 2% on this machine): ZeRO model state, per-block activations by tp / SP / cp /
recomputation, the head's, and the schedule's peak microbatches in flight (``PEAK_IN_FLIGHT``,
closed forms checked against ``loom.schedule.validate.peak_memory`` in the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

from loom.formulas.flops import attended_keys, model_flops_per_token
from loom.formulas.memory import adamw_step_fused
from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.layout import CPLayout  # Loom's own split of cp into u x r
from loom.schedule.cost import OpCosts, StageCosts
from loom.sim.collectives import (allreduce_time, gather_time, p2p_time,
                                  spanning_all_to_all_time)
from loom.sim.dp_cost import data_parallel_time
from loom.sim.cost_memory import layout_memory
from loom.sim import expert_cost, fp8_cost
from loom.sim.eager_cost import eager_extra_bytes
from loom.sim.frameworks import LOOM, Framework
from loom.sim.launch_cost import block_kernels, host_bound
from loom.sim.pipeline_estimate import pipeline_estimate
from loom.sim.optimizer_cost import step_traffic
from loom.sim.rank_params import RankParams
from loom.sim.recompute_cost import recomputed
from loom.sim.streams import Pieces, chunked_overlap, layer_overlap
from loom.sim.tp_overlap_cost import sm_margin_seconds
from loom.sim.vocab_cost import (VocabPasses, vocab_pass_times, vocab_pp, vocab_shares,
                                 vocab_stats_time)

ELEMENTWISE_PASSES = 20  # activation-sized reads + writes per layer forward (see docstring)
# FlashAttention (v1) against FlashAttention-2, which the core's matmul rate prices: "around 2x"
# slower (Dao 2023, arXiv 2307.08691, abstract and §4.1)
FLASH1_SLOWDOWN = 2.0
# The attention core's backward against its forward: a flash kernel recomputes the scores QK^T
# beside dV, dP, dQ and dK, five matmuls against the forward's two (FlashAttention-2, arXiv
# 2307.08691 §3.1.2; flash-attention's benchmarks count the backward at 2.5x the forward's
# FLOPs); a kernel that stores the scores runs the four without the recomputation
FLASH_BACKWARD, STORED_BACKWARD = 2.5, 2.0
# Kernels that store the s x s scores: e-byte passes over them, (forward, backward). Fused: the
# QK^T output written, read and written by the scale-mask-softmax kernel, read by PV; backward,
# dP written, P read for dV, P and dP read and dS written by the softmax's backward, dS read for
# dQ and for dK. Unfused: scale and mask as two more read-write kernels each way.
SCORE_PASSES = {"fused": (4, 7), "unfused": (8, 11)}
# Bytes per activation element a block's two RMSNorms move beyond a fused kernel's read and
# write when run as eager ops in fp32 (``Framework.fused_norm`` false; Llama's reference
# RMSNorm on bf16 input: upcast 2 + 4, square 4 + 4, mean 4, scale 4 + 4, downcast 4 + 2,
# weight 2 + 2 = 36 against 4, per norm), forward; backward twice that, as every element-wise
# pass here
UNFUSED_NORM_BYTES = 64


class _LazyStageCosts:
    """Per-stage (F, I, W) and the send time; the validated ``StageCosts`` is built on demand
    (thousands of layouts are priced, a few are simulated)."""

    def __init__(self, ops: Sequence[tuple[float, float, float]], send: float):
        self.ops, self.send = ops, send

    def build(self) -> StageCosts:
        return StageCosts(tuple(OpCosts(f, i, w) for f, i, w in self.ops), latency=self.send)


@dataclass
class StepCost:
    """What ``CostModel.evaluate`` predicts for one layout (seconds, bytes, FLOPs)."""

    layout: Layout
    stage_costs: _LazyStageCosts | None  # per global stage, for the simulator (None: pp == 1)
    compute: float  # one rank's F+I+W over the step, with the exposed tp/cp/ep communication
    pipeline: float  # the forward/backward part of the step (simulated or analytical)
    dp_exposed: float
    optimizer: float
    memory: dict[str, float]
    model_flops: float  # per step, all ranks (MFU numerator)
    hardware_flops: float  # per step, all ranks, with recomputation
    comm: dict[str, float] = field(default_factory=dict)  # seconds per step by axis (exposed)
    simulated: bool = False

    @property
    def step_time(self) -> float:
        return self.pipeline + self.dp_exposed + self.optimizer

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def bubble(self) -> float:
        """Fraction of the pipeline part a rank idles (makespan minus the busiest rank's work)."""
        return max(0.0, 1 - self.compute / self.pipeline) if self.pipeline else 0.0


class CostModel:
    """Prices layouts of ``model`` at ``seq_len`` with ``global_batch`` sequences per step."""

    def __init__(self, model: TransformerArgs, seq_len: int, global_batch: int, cluster: Any, *,
                 dtype_bytes: int = 2, grad_bytes: int | None = None,
                 op_overhead: float | None = None, framework: Framework = LOOM,
                 fp8: bool | str = False, fp8_all_gather: bool = False, grad_clip: bool = True):
        self.model, self.seq, self.batch, self.cluster = model, seq_len, global_batch, cluster
        self.grad_clip = grad_clip  # gradients scaled by the clipping factor (train.grad_clip > 0)
        # FP8 matmuls in the blocks' linears (``train.fp8``'s recipe, ``loom.sim.fp8_cost``),
        # and FSDP2's float8 all-gather of their weights (``train.fp8_all_gather``)
        self.fp8_recipe = fp8_cost.recipe_of(fp8, cluster.gpu, fp8_all_gather)
        self.fp8 = self.fp8_recipe != "none"
        self.fp8_all_gather = fp8_all_gather
        self.framework = framework  # memory layout and overlap defaults (loom.sim.frameworks)
        self.e = dtype_bytes
        self.grad_bytes = framework.grad_bytes if grad_bytes is None else grad_bytes
        self.op_overhead = cluster.gpu.op_overhead if op_overhead is None else op_overhead
        # which layers and parameters each pipeline rank holds (loom.sim.rank_params)
        self.ranks = RankParams(model, fp8_all_gather=fp8_all_gather,
                                loom_trainer=framework.is_loom)
        self.moe_layers = self.ranks.moe_layers
        self._times_cache: dict[tuple, tuple] = {}
        self._memory_cache: dict[tuple, dict] = {}
        self._memory_floor_cache: dict[tuple, float] = {}  # cost_memory.memory_floor
        self._instants_cache: dict[tuple, list] = {}  # cost_memory._instants
        self._per_mb_cache: dict[tuple, dict] = {}  # cost_memory._per_microbatch
        self._activation_cache: dict[tuple, tuple] = {}  # cost_memory._activation_bytes
        self._model_flops: float | None = None
        self._overlap_cache: dict[tuple, float] = {}  # streams.layer_overlap answers
        self._ops_cache: dict[tuple, tuple] = {}  # _ops_and_busiest
        self._floor_cache: dict[tuple, float] = {}  # compute_floor's busiest rank

    # ----- FLOPs -------------------------------------------------------------------------
    def layer_flops(self, tokens: float, tp: int, moe: bool) -> tuple[float, float]:
        """(matmul FLOPs outside the attention core, causal attention-core FLOPs) of one layer's
        forward for ``tokens`` tokens on one rank, split by ``tp``."""
        m = self.model
        d = m.head_dim
        proj = 2 * tokens * m.dim * d * (2 * m.n_heads + 2 * m.n_kv_heads)
        if moe:
            width = m.expert_ffn_dim or m.ffn_dim
            # the experts (routed and shared) are of the dense MLP's kind: 3 or 2 matrices
            mlp = 2 * m.mlp_matrices * tokens * m.dim * width * (m.top_k + m.n_shared_experts)
            router = 2 * tokens * m.dim * m.n_experts
        else:
            mlp, router = 2 * m.mlp_matrices * tokens * m.dim * m.ffn_dim, 0.0
        # causal: half the square; a sliding window: its visible pairs (``attended_keys``)
        core = 4 * tokens * attended_keys(self.seq, m.sliding_window) * m.n_heads * d
        return (proj + mlp) / tp + router, core / tp

    @property
    def zero12_gather_bytes(self) -> int:
        """Bytes per element of ZeRO-1/2's parameter all-gather after the step: the profile's,
        or the parameters' own dtype where it says 0 (Loom's trainer gathers what it trains
        in: bf16 under ``train.dtype = bf16``)."""
        return self.framework.zero12_gather_bytes or self.e

    @property
    def core_backward(self) -> float:
        """The attention core's backward seconds per forward second under the framework's
        kernel (``FLASH_BACKWARD`` for a flash kernel, ``STORED_BACKWARD`` otherwise)."""
        return FLASH_BACKWARD if self.framework.flash_attention else STORED_BACKWARD

    def model_flops_per_step(self) -> float:
        if self._model_flops is None:
            self._model_flops = self._count_model_flops()
        return self._model_flops

    def _count_model_flops(self) -> float:
        """MFU's numerator for one step: the trainer's own count (``loom.formulas.flops``, full
        attention square, MoE layers by their active experts) over every token of the step."""
        return self.batch * self.seq * model_flops_per_token(self.model, self.seq)

    # ----- time of one layer pass ----------------------------------------------------------
    def _layer_times(self, lay: Layout, moe: bool) -> tuple[float, float, float, dict[str, float]]:
        """(F, I, W) seconds of one layer for one microbatch on one rank, with the exposed tp /
        cp / ep communication, and that communication by axis (forward + backward)."""
        m, gpu, c = self.model, self.cluster.gpu, self.cluster
        s_local = self.seq // lay.cp
        tokens = lay.micro_batch * s_local
        mat, core = self.layer_flops(tokens, lay.tp, moe)
        expert_width = (m.expert_ffn_dim or m.ffn_dim) / lay.tp
        routed = expert_cost.routed_flops(m, tokens, lay.tp) if moe else 0.0
        # the GEMMs beside the routed experts: the projections, and the dense MLP or the
        # shared experts (n_shared x F_e wide, as one)
        widths = min(m.dim / lay.tp, (expert_width * m.n_shared_experts if m.n_shared_experts
                                      else math.inf) if moe else m.ffn_dim / lay.tp)
        converted = cast_elements = 0.0
        if self.fp8:
            converted, cast_elements = fp8_cost.converted_share(m, tokens, lay.tp, moe)
        fp8_gain = 1 - gpu.peak_flops / gpu.fp8_flops if self.fp8 and gpu.fp8_flops else 0.0
        routed_fp8 = routed if self.framework.fp8_experts else 0.0
        if routed_fp8 and fp8_gain:
            cast_elements += expert_cost.routed_cast_elements(m, tokens, lay.tp)

        def gemms(rows: float, gain: float = fp8_gain) -> float:
            """Seconds of the layer's GEMMs run as pieces of ``rows`` rows each (the FP8 share
            at the FP8 peak, ``gain`` of its time saved): the smallest dimension sets the
            efficiency. A routed expert's GEMMs get its share of the assignments, balanced:
            rows x top_k over the experts, times ep (a rank runs its E / ep experts on the
            tokens every ep rank sends it)."""
            t = (mat - routed - converted * gain) / gpu.matmul_rate(min(rows, widths))
            if routed:
                per_expert = expert_cost.rows_per_expert(m, rows, lay.ep)
                t += (routed - routed_fp8 * gain) / gpu.matmul_rate(
                    min(per_expert, expert_width))
            return t

        t_mat = gemms(tokens)
        t_cast = fp8_cost.cast_bytes(cast_elements, self.e) / gpu.hbm_bandwidth
        # the weight gradient's GEMMs and casts, as the recipe runs them (fp8_cost)
        t_mat_w, t_cast_w = t_mat, 0.0
        if self.fp8:
            in_fp8, passes = fp8_cost.weight_gradient(self.fp8_recipe, self.framework.compiled)
            t_mat_w = t_mat if in_fp8 else gemms(tokens, gain=0.0)
            t_cast_w = t_cast * passes
        t_core = core / gpu.matmul_rate(min(s_local, m.head_dim))
        t_scores_f = t_scores_i = 0.0  # the stored scores' memory traffic (non-flash kernels)
        kernel = self.framework.attention_kernel
        if kernel == "flash1":
            t_core *= FLASH1_SLOWDOWN
        elif kernel in SCORE_PASSES:  # the whole square (no causal skipping), scores stored
            t_core *= self.seq / attended_keys(self.seq, m.sliding_window)
            scores = lay.micro_batch * m.n_heads / lay.tp * s_local * self.seq * self.e
            passes_f, passes_i = SCORE_PASSES[kernel]
            t_scores_f = passes_f * scores / gpu.hbm_bandwidth
            t_scores_i = passes_i * scores / gpu.hbm_bandwidth
        split = ELEMENTWISE_PASSES if lay.sequence_parallel and lay.tp > 1 else 12
        kept = 0 if lay.sequence_parallel and lay.tp > 1 else ELEMENTWISE_PASSES - 12
        t_elem = tokens * m.dim * self.e * (kept + split / lay.tp) / gpu.hbm_bandwidth
        if moe:
            t_elem += tokens * m.dim * self.e * expert_cost.permute_passes(m.top_k, lay.ep) \
                / gpu.hbm_bandwidth
        t_eager_f = t_eager_i = 0.0
        if not self.framework.compiled:  # one kernel per element-wise op (the norms' too,
            # unless the stack has a norm kernel)
            extra_f, extra_i = eager_extra_bytes(m, tokens, lay.tp, lay.sequence_parallel, moe,
                                                 self.e, norm_kernel=self.framework.fused_norm)
            t_eager_f, t_eager_i = extra_f / gpu.hbm_bandwidth, extra_i / gpu.hbm_bandwidth
        elif not self.framework.fused_norm:  # the norms as eager fp32 ops (split under SP)
            t_elem += tokens * m.dim * UNFUSED_NORM_BYTES / (
                lay.tp if lay.sequence_parallel else 1) / gpu.hbm_bandwidth
        comm: dict[str, float] = {}
        # tensor parallelism: 2 all-reduces (or AG + RS pairs) each way
        tp_link = c.link_for(lay.tp, 1)
        tp_one = allreduce_time(tokens * m.dim * self.e, lay.tp, tp_link)
        tp_fwd = 2 * tp_one
        # context parallelism
        cp_fwd = cp_bwd = 0.0
        if lay.cp > 1:
            split = CPLayout.from_mode(lay.cp_mode, lay.cp)
            ulysses, ring = split.ulysses, split.ring
            stride = self.group_strides(lay)["cp"]
            if ulysses > 1:
                qkvo = tokens * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) / lay.tp * self.e
                cp_fwd += spanning_all_to_all_time(qkvo, ulysses, stride, c)
                cp_bwd += spanning_all_to_all_time(qkvo, ulysses, stride, c)
            if ring > 1 and split.gather:  # all-gather cp (loom.parallel.allgather_attention)
                # every rank's keys and values gathered before the attention, again in the
                # backward, and their fp32 gradients reduce-scattered after it: not overlapped
                kv_all = 2 * tokens * m.n_kv_heads * m.head_dim / lay.tp * self.e * ring
                link = c.link_for(ring, stride)
                cp_fwd += gather_time(kv_all, ring, link)
                cp_bwd += gather_time(kv_all, ring, link) + gather_time(kv_all * 4 / self.e,
                                                                        ring, link)
            elif ring > 1:
                kv = 2 * tokens * m.n_kv_heads * m.head_dim / lay.tp * self.e * ulysses
                link = c.link_for(ring, stride * ulysses)
                block = t_core / ring if self.overlaps else 0.0
                cp_fwd += (ring - 1) * max(0.0, p2p_time(kv, link) - block)
                cp_bwd += (ring - 1) * max(0.0, p2p_time(2 * kv, link)
                                           - self.core_backward * block)
        ep_fwd = 0.0
        if moe and lay.ep > 1:
            rows = tokens * m.top_k * m.dim * self.e
            ep_fwd = 2 * spanning_all_to_all_time(rows, lay.ep, self.group_strides(lay)["ep"], c)
        per_pass, _, per_token = gpu.framework_overhead(wrappers(lay))
        overhead = self.op_overhead + per_pass + per_token * tokens
        # compute (and framework work) slows down when ranks share processors; communication
        # was measured with every rank taking part, so it is not scaled again
        slow = self._compute_slowdown(lay)
        tp_exposed = tp_fwd
        if self.framework.overlap.tp_comm and lay.sequence_parallel and tp_fwd and self.overlaps:
            # pipelined with the GEMMs in tp chunks (Megatron's TP-comm overlap needs SP): each
            # chunk's GEMM has 1/tp of the rows, so a GEMM the chunks make narrower runs less
            # efficiently, and that loss is the overlap's price beside its first exposed chunk
            tp_exposed = chunked_overlap(gemms(tokens / lay.tp) * slow, tp_fwd, lay.tp) \
                - t_mat * slow
            # the GEMMs Transformer Engine launches beside its communication kernels run on the
            # SMs left to them: the forward's row-parallel ones, the backward's column-parallel
            margin_f, margin_b = sm_margin_seconds(
                m, tokens, lay.tp, moe, gpu.sms, self.framework.tp_overlap_sms, t_mat / mat * slow)
        else:
            margin_f = margin_b = 0.0
        # the host queues each pass's kernels ahead of the device: a pass of short kernels
        # takes their launches' host time instead (loom.sim.launch_cost)
        k_f, k_i, k_w = block_kernels(m, moe, self.framework.compiled, self.e, lay.ep,
                                      self.framework.grouped_experts)
        launch = gpu.launch_overhead
        f_compute = host_bound((t_mat + t_cast + t_core + t_scores_f + t_elem + t_eager_f
                                + overhead) * slow, k_f, launch)
        f = f_compute + tp_exposed + margin_f + cp_fwd + ep_fwd
        i = host_bound((t_mat + t_cast + self.core_backward * t_core + t_scores_i + 2 * t_elem
                        + t_eager_i
                        + overhead) * slow, k_i, launch) + tp_exposed + margin_b + cp_bwd + ep_fwd
        w = host_bound((t_mat_w + t_cast_w + overhead) * slow, k_w, launch) + margin_b
        # what the policy runs again in backward (loom.sim.recompute_cost): a share of the
        # whole forward (full: all blocks; every_k: every k-th, spread evenly over the
        # layers), or a selective part of it
        redo = recomputed(lay, self.framework.selective, m, tokens, lay.tp, moe)
        again = redo.forward_share
        i += again * f
        comm_tp = (1 + again) * tp_fwd
        if redo.elementwise:
            i += (redo.matmul_flops / gpu.matmul_rate(min(tokens, widths)) + t_elem
                  + t_eager_f) * slow
        if redo.attention_core:
            i += (t_core + t_scores_f) * slow
        if self.framework.is_loom and lay.sequence_parallel and lay.tp > 1 and again < 1:
            # Loom's SP saves the linears' gathered inputs as the rank's slice and all-gathers
            # them again in backward (loom.parallel.sequence_saved): one all-gather per block
            # part, half an all-reduce's time each, not overlapped (a recomputed block has them)
            i += (1 - again) * tp_one
            comm_tp += (1 - again) * tp_one
        comm = {"tp": tp_fwd + comm_tp, "cp": cp_fwd + cp_bwd, "ep": 2 * ep_fwd}
        return f, i, w, comm

    def _head_times(self, lay: Layout) -> tuple[float, float, float]:
        m, gpu = self.model, self.cluster.gpu
        tokens = lay.micro_batch * self.seq // lay.cp
        flops = 2 * tokens * m.dim * m.vocab_size / lay.tp
        t = flops / gpu.matmul_rate(min(tokens, m.dim, m.vocab_size / lay.tp))
        # log-softmax over the logits: read and write them twice (fp32)
        t_elem = 4 * tokens * m.vocab_size / lay.tp * 4 / gpu.hbm_bandwidth
        slow = self._compute_slowdown(lay)
        return (t + t_elem) * slow, (t + t_elem) * slow, t * slow

    # ----- ranks that share processors (a CPU profile) -------------------------------------
    @property
    def contention(self) -> float:
        """How much slower a rank computes when every rank of a node is busy: ranks per node
        over the node's cores (1 when each rank has its own processor)."""
        cores = self.cluster.gpu.cores
        if not cores:
            return 1.0
        return max(1.0, min(self.cluster.gpus, self.cluster.gpus_per_node) / cores)

    @property
    def overlaps(self) -> bool:
        """Whether communication can hide behind compute: only when each rank has a processor
        of its own. Ranks sharing cores (a CPU profile) keep every core busy computing, and the
        collectives' copies and reductions (gloo's threads) take their turn on the same cores,
        so they add to the step instead of hiding in it."""
        return self.contention <= 1.0

    def _compute_slowdown(self, lay: Layout) -> float:
        """The slowdown charged to compute: the full contention when every rank computes at
        once (no pipeline); under a pipeline, ranks idle in its bubbles, so the simulation
        shares the cores itself (``shared_cores``) and the per-op costs stay uncontended."""
        return 1.0 if lay.pp > 1 else self.contention

    def shared_cores(self, lay: Layout) -> float:
        """Cores one pipeline's ranks share (0: each has its own): the node's cores split
        evenly among the pipelines (data-parallel replicas) that run on it at once."""
        cores = self.cluster.gpu.cores
        if not cores:
            return 0.0
        ranks = min(self.cluster.gpus, self.cluster.gpus_per_node)
        return min(float(lay.pp), cores * lay.pp / ranks)

    def _charged_wrappers(self, lay: Layout) -> tuple[str, ...]:
        """``wrappers(lay)`` where the accelerator charges framework work by wrapper (a CPU
        profile's ``Gpu.framework``), else (): the layer times do not depend on them then, and
        the caches keyed by them hit across ZeRO stages and data-parallel splits."""
        return wrappers(lay) if self.cluster.gpu.framework else ()

    def _times(self, lay: Layout, moe: bool) -> tuple[float, float, float, dict[str, float]]:
        key = (lay.tp, lay.cp, lay.cp_mode, lay.ep, lay.sequence_parallel, lay.micro_batch,
               lay.recompute, lay.recompute_every, moe, self._charged_wrappers(lay))
        if key not in self._times_cache:
            self._times_cache[key] = self._layer_times(lay, moe)
        return self._times_cache[key]

    def layer_pass_times(self, lay: Layout) -> tuple[float, float, float]:
        """(F, I, W) seconds of the model's average layer (dense and MoE layers weighed by
        their counts) for one microbatch on one rank of ``lay``, with its exposed tp / cp / ep
        communication: what a pipeline stage of n layers costs n times
        (``loom.plan.mixed`` splits layers unevenly over unlike accelerators with it)."""
        dense = self._times(lay, False)
        moe = self._times(lay, True) if self.moe_layers else dense
        n, k = self.model.n_layers, self.moe_layers
        return tuple(((n - k) * d + k * e) / n for d, e in zip(dense[:3], moe[:3]))

    def head_pass_times(self, lay: Layout) -> tuple[float, float, float]:
        """(F, I, W) seconds of the final norm, output layer and loss for one microbatch on the
        last stage's rank of ``lay``."""
        return self._head_times(lay)

    # ----- the whole step ------------------------------------------------------------------
    def evaluate_ops(self, lay: Layout) -> tuple[tuple[float, float, float], ...]:
        """(F, I, W) seconds of one microbatch on each global stage of ``lay`` (the last also
        runs the head), cached with the busiest rank's F+I+W: layouts that differ only in data
        parallelism (ZeRO stage, replicate vs shard, microbatch count) share them."""
        return self._ops_and_busiest(lay)[0]

    def compute_floor(self, lay: Layout) -> float:
        """A lower bound of ``evaluate(lay).step_time`` at a fraction of its price: the busiest
        rank's passes over all microbatches, before any bubble, exposed communication or
        optimizer step (the planner skips layouts whose floor cannot beat those it keeps).
        Summed per rank, not per stage as ``evaluate`` does, so it is lowered by a rounding
        margin to stay below that sum."""
        # the busiest rank's passes per microbatch, cached by what they depend on (the planner
        # asks for tens of thousands of layouts that differ in data parallelism and m alone)
        key = (lay.pp, lay.chunks, lay.v_shaped, lay.tp, lay.cp, lay.cp_mode, lay.ep,
               lay.sequence_parallel, lay.micro_batch, lay.recompute, lay.recompute_every,
               self._charged_wrappers(lay), vocab_pp(lay))
        busiest = self._floor_cache.get(key)
        if busiest is None:
            dense = self._times(lay, False)
            moe = self._times(lay, True) if self.moe_layers else dense
            head = self._head_times(lay)
            per_layer = (sum(dense[:3]), sum(moe[:3]))
            tail = sum(head)
            spread = vocab_pp(lay)  # every rank runs 1/p of the head (its messages left out)
            busiest = self._floor_cache[key] = max(
                nd * per_layer[0] + nm * per_layer[1]
                + (tail / lay.pp if spread else tail if last else 0.0)
                for nd, nm, last in self.ranks.rank_layers(lay.pp, lay.chunks, lay.v_shaped))
        return busiest * lay.microbatches * (1 - 1e-9)

    def _ops_and_busiest(self, lay: Layout) -> tuple[tuple[tuple[float, float, float], ...],
                                                     float]:
        key = (lay.pp, lay.chunks, lay.v_shaped, lay.tp, lay.cp, lay.cp_mode, lay.ep,
               lay.sequence_parallel, lay.micro_batch, lay.recompute, lay.recompute_every,
               self._charged_wrappers(lay), vocab_pp(lay))
        cached = self._ops_cache.get(key)
        if cached is None:
            ops = self._stage_ops(lay)
            # ranks whose stages hold the same layers have the same ops (``_stage_ops``): one
            # of each is summed, unless the vocabulary's passes differ from stage to stage
            ranks = self.ranks.geometry(lay.pp, lay.chunks, lay.v_shaped)[2] if vocab_pp(lay) \
                else self.ranks.distinct_ranks(lay.pp, lay.chunks, lay.v_shaped)
            passes = [f + i + w for f, i, w in ops]  # each stage's F+I+W, then per rank
            busiest = max(sum([passes[s] for s in own]) for own in ranks)
            cached = self._ops_cache[key] = (ops, busiest)
        return cached

    def _stage_ops(self, lay: Layout) -> tuple[tuple[float, float, float], ...]:
        counts, _, owned = self.ranks.geometry(lay.pp, lay.chunks, lay.v_shaped)
        dense = self._times(lay, False)
        moe = self._times(lay, True) if self.moe_layers else dense
        head = self._head_times(lay)
        last = len(counts) - 1
        shares = self._vocab_shares(lay, owned) if vocab_pp(lay) else None
        ops = []
        alike: dict[tuple[int, int], tuple[float, float, float]] = {}  # by (dense, MoE) layers
        for s, (nd, nm) in enumerate(counts):
            if shares is None and s != last:  # the same layers, the same costs: computed once
                op = alike.get((nd, nm))
                if op is None:
                    op = alike[nd, nm] = (nd * dense[0] + nm * moe[0],
                                          nd * dense[1] + nm * moe[1],
                                          nd * dense[2] + nm * moe[2])
                ops.append(op)
                continue
            f = nd * dense[0] + nm * moe[0]
            i = nd * dense[1] + nm * moe[1]
            w = nd * dense[2] + nm * moe[2]
            if shares is not None:  # every rank's S and T, spread over its stages
                f, i, w = (x + y for x, y in zip((f, i, w), shares[s]))
            elif s == last:
                f, i, w = f + head[0], i + head[1], w + head[2]
            ops.append((f, i, w))
        return tuple(ops)

    def vocab_pass_times(self, lay: Layout) -> VocabPasses:
        """Vocabulary parallelism across the pipeline, per microbatch: (S on one rank, T on one
        rank, the last stage's extra forward, its extra backward, the step's edges), from this
        model's head times and links (``loom.sim.vocab_cost.vocab_pass_times``)."""
        c = self.cluster
        return vocab_pass_times(
            lay, self.model.dim, self.seq, self.e, self._head_times(lay),
            c.link_for(lay.pp, self.group_strides(lay)["pp"]), c.link_for(lay.tp, 1))

    def _vocab_shares(self, lay: Layout, owned: Sequence[Sequence[int]]
                      ) -> list[tuple[float, float, float]]:
        """Per global stage, the (F, I, W) seconds its rank's vocabulary passes add
        (``loom.sim.vocab_cost.vocab_shares``)."""
        return vocab_shares(lay.pp, owned, self.vocab_pass_times(lay), self._head_times(lay))

    def evaluate(self, lay: Layout, memory: dict[str, float] | None = None) -> StepCost:
        """Price ``lay`` (``memory``: its ``self.memory(lay)`` when already computed). The
        pipelined part is a fast analytical estimate here (``pipeline_estimate``; ``simulate_step``
        replaces it by the simulator's makespan)."""
        m = self.model
        counts, placement, owned = self.ranks.geometry(lay.pp, lay.chunks, lay.v_shaped)
        dense = self._times(lay, False)
        moe = self._times(lay, True) if self.moe_layers else dense
        ops, compute, pipeline, send = self._pipeline_part(lay)
        stage_costs = _LazyStageCosts(ops, send) if lay.pp > 1 else None
        per_rank_mb = lay.microbatches / lay.pp
        n_dense = m.n_layers - self.moe_layers
        comm = {k: (n_dense * dense[3][k] + self.moe_layers * moe[3][k]) * per_rank_mb
                for k in ("tp", "cp", "ep")}
        if lay.pp > 1:
            comm["pp"] = 2 * send * per_rank_mb * lay.pp * lay.chunks
            if vocab_pp(lay):  # the split embedding's messages, and the statistics' exchange
                passes = self.vocab_pass_times(lay)
                s_pass, t_pass, x_out, dx_in, edges = passes
                stats = vocab_stats_time(passes, self._head_times(lay), lay.pp)
                comm["pp_vocab"] = (edges + stats + x_out + dx_in) * lay.microbatches
        # data parallelism and the optimizer on the end ranks (embedding, head: the worst)
        rank_params = self.ranks.end_rank_params(lay)
        rank_fwd, rank_bwd, rank_layers = {}, {}, {}
        for r in rank_params:
            rank_fwd[r] = sum(ops[s][0] for s in owned[r])
            rank_bwd[r] = sum(ops[s][1] + ops[s][2] for s in owned[r])
            rank_layers[r] = sum(sum(counts[s]) for s in owned[r])
        dp_exposed, comm["dp"] = data_parallel_time(self, lay, rank_params, rank_fwd, rank_bwd,
                                                    rank_layers)
        optimizer = self._optimizer_time(lay)
        memory = memory if memory is not None else self.memory(lay)
        model_flops = self.model_flops_per_step()
        # what the policy runs again, over the step (loom.sim.recompute_cost; the attention
        # core counted as MFU counts it, the whole square)
        tokens = self.batch * self.seq
        extra = 0.0
        for moe, layers in ((False, m.n_layers - self.moe_layers), (True, self.moe_layers)):
            redo = recomputed(lay, self.framework.selective, m, tokens, 1, moe)
            extra += layers * redo.matmul_flops
            if redo.attention_core:
                extra += tokens * layers * self.layer_flops(1, 1, moe)[1] * 2
        extra += model_flops / 3 * redo.forward_share
        return StepCost(lay, stage_costs, compute, pipeline, dp_exposed, optimizer, memory,
                        model_flops, model_flops + extra, comm)

    def _pipeline_part(self, lay: Layout
                       ) -> tuple[tuple[tuple[float, float, float], ...], float, float, float]:
        """``evaluate``'s (per-stage ops, the busiest rank's compute over the step, the pipelined
        part's estimate, one stage-boundary send) of ``lay``."""
        ops, busiest = self._ops_and_busiest(lay)
        compute = busiest * lay.microbatches  # compute_floor(lay), but for its rounding margin
        if lay.pp > 1 and self.shared_cores(lay):  # the busiest rank's work at its share of cores
            compute *= max(1.0, lay.pp / self.shared_cores(lay))
        if lay.pp == 1:
            return ops, compute, compute, 0.0
        send = self.send_time(lay)
        pipeline = pipeline_estimate(lay, ops, busiest, send, self.contention)
        if vocab_pp(lay):  # the split embedding's messages at the step's edges, exposed
            pipeline += self.vocab_pass_times(lay)[4] * lay.microbatches
        return ops, compute, pipeline, send

    def _optimizer_time(self, lay: Layout) -> float:
        """``evaluate``'s optimizer seconds: the framework's gradient handling and AdamW step
        (loom.sim.optimizer_cost); a CPU profile measures its AdamW step instead (torch's
        multi-tensor AdamW, several passes). Per-step framework work (optimizer over many
        tensors, hooks, the loss) runs on every rank at once, so it is always charged the full
        contention."""
        gpu = self.cluster.gpu
        optimizer = self.stepped_parameters(lay) * gpu.optimizer_per_param \
            if gpu.optimizer_per_param else self.optimizer_bytes(lay) / gpu.hbm_bandwidth
        return (optimizer + gpu.framework_overhead(wrappers(lay))[1]) * self.contention

    def step_floor(self, lay: Layout) -> float:
        """A lower bound of ``evaluate(lay).step_time`` without its data-parallel part, the
        dearest to price: the same pipelined part and optimizer step, the exposed
        communication taken as none. ``step_time`` adds the latter (>= 0) first, and rounding
        is monotonic, so the bound holds exactly, without a margin; the planner skips a layout
        whose bound is slower than every layout it keeps."""
        return self._pipeline_part(lay)[2] + self._optimizer_time(lay)

    def stepped_parameters(self, lay: Layout) -> float:
        """Parameters the busiest end rank steps: its ZeRO slices (dense ones also over ep), or
        all it holds without ZeRO; what an outer loop synchronises per rank, too."""
        return max(stepped for _, stepped in self._held_and_stepped(lay).values())

    def zero_stage_of(self, lay: Layout) -> int:
        """The ZeRO stage ``lay`` runs, 0 where nothing is sharded. Loom's trainer shards over
        dp_shard x cp only with dp_shard > 1 (its config rules); another stack's FSDP or ZeRO
        mesh is dp_shard x cp, so the cp ranks alone shard it (torchtitan's "FSDP 1, CP 8"),
        and its dense parameters' shards span the expert ranks too (Megatron's distributed
        optimizer over a data-parallel group that holds ep: "EP 16" at dp 16 shards them 16
        ways while each expert has one replica)."""
        shards = lay.dp_shard if self.framework.is_loom else lay.dp_shard * lay.cp * lay.ep
        return lay.zero_stage if shards > 1 else 0

    def _held_and_stepped(self, lay: Layout) -> dict[int, tuple[float, float]]:
        """Per end rank, (parameters it holds, parameters it steps: ``stepped_parameters``)."""
        experts = self.ranks.end_rank_expert_params(lay)
        out = {}
        for r, psi in self.ranks.end_rank_params(lay).items():
            stepped = psi
            if self.zero_stage_of(lay):
                d = lay.dp_shard * lay.cp
                stepped = (psi - experts[r]) / (d * lay.ep) + experts[r] / d
            out[r] = (psi, stepped)
        return out

    def optimizer_bytes(self, lay: Layout) -> float:
        """HBM bytes of the busiest end rank's gradient handling and optimizer step per step
        (``loom.sim.optimizer_cost.step_traffic`` of the framework's code path): Loom's and
        torchtitan's parameters are bf16 with fp32 masters (FSDP2's bf16 ``param_dtype``) at
        2-byte compute, the others' when their parameters are 2-byte."""
        fw = self.framework
        stage = self.zero_stage_of(lay)
        master = self.e == 2 if fw.step_path in ("loom", "torchtitan") else fw.param_bytes == 2
        fused = fw.step_path != "loom" or adamw_step_fused(
            "auto", tp=lay.tp, zero_stage=stage, sequence_parallel=lay.sequence_parallel,
            vocab_parallel=lay.vocab_parallel, moe=self.moe_layers > 0,
            vocab_parallel_pp=lay.vocab_parallel_pp)
        # ZeRO-3 gathers each parameter for every forward and backward, or once per step for a
        # pipeline stage kept gathered (the planner's pipelined ZeRO-3); torchtitan's ZeRO-1/2
        # are FSDP2 kept gathered across the step
        gathers = 2 * lay.microbatches if stage == 3 and lay.pp == 1 else 1 if stage else 0
        traffic = step_traffic(fw.step_path, microbatches=lay.microbatches, master=master,
                               zero_stage=stage, gathers=gathers, clip=self.grad_clip,
                               fused=fused)
        return max(traffic.bytes(held, stepped)
                   for held, stepped in self._held_and_stepped(lay).values())

    def group_strides(self, lay: Layout) -> dict[str, int]:
        """The rank distance of each group the model prices (``Framework.group_strides``)."""
        return self.framework.group_strides(
            (lay.tp, lay.cp, lay.ep, lay.dp_shard, lay.dp_replicate, lay.pp))

    def send_time(self, lay: Layout, link: Any = None) -> float:
        """One activation (or its gradient) across a stage boundary: T·h·e, T·h·e/t under SP,
        over the pipeline group's link of this cluster, or ``link`` (a hop between clusters)."""
        act = lay.micro_batch * self.seq / lay.cp * self.model.dim * self.e
        if lay.sequence_parallel and lay.tp > 1:
            act /= lay.tp
        return p2p_time(act, link or self.cluster.link_for(
            lay.pp, self.group_strides(lay)["pp"]))

    def queued_overlap(self, layers: int, slice_: float, pieces: list[Pieces],
                 slack: float = 0.0) -> float:
        """``streams.layer_overlap``, cached per model (the same few shapes recur across the
        hundreds of thousands of layouts the planner screens)."""
        key = (layers, slice_, tuple(pieces), slack)
        value = self._overlap_cache.get(key)
        if value is None:
            value = self._overlap_cache[key] = layer_overlap(layers, slice_, pieces, slack)
        return value

    # ----- memory --------------------------------------------------------------------------
    def memory(self, lay: Layout, in_flight: tuple[float, ...] | None = None
               ) -> dict[str, float]:
        """Bytes by component on the worst pipeline rank (``cost_memory.layout_memory``; checked
        first: most layouts of a large model do not fit, and it is a fraction of ``evaluate``);
        ``in_flight``: a known schedule's peak units per rank."""
        return layout_memory(self, lay, in_flight)

    def memory_total(self, lay: Layout) -> float:
        """The sum of ``memory(lay)``, without building it (the planner's screening)."""
        return layout_memory(self, lay, total_only=True)


# -- the wrappers a layout runs through (the collectives' alpha-beta times: loom.sim.collectives) -
def wrappers(lay: Layout) -> tuple[str, ...]:
    """The parallel wrappers a layout runs its layers through, by the names the calibration
    measures their framework work under (``Gpu.framework``): "base" always (Loom's trainer with
    data parallelism), then DTensor tensor parallelism, ZeRO-3's FSDP2 units, ZeRO-2's
    gradient hooks and buckets or ZeRO-1's buckets after the backward, ring and/or Ulysses
    attention, and the pipeline interpreter."""
    names = ["base"]
    if lay.tp > 1:
        names.append("tp")
    if lay.dp_shard > 1 and lay.zero_stage:
        names.append(f"zero{lay.zero_stage}")
    if lay.cp > 1:
        if lay.cp_mode in ("ring", "hybrid", "allgather"):  # (all-gather: the ring's blocks)
            names.append("ring")
        if lay.cp_mode in ("ulysses", "hybrid"):
            names.append("ulysses")
    if lay.pp > 1:
        names.append("pp")
    return tuple(names)


def search_costs(model: Any, lay: Layout) -> str:
    """``parallel.schedule_costs`` for a searched schedule of ``lay`` under ``model`` (a
    ``CostModel``): each rank's F, I, W for its whole share (the end ranks carry the embedding
    and the head) and the send latency, relative to the busiest rank's F, to three digits. The
    search splits a rank's share evenly among its chunks; the simulation replays every stage's
    own costs."""
    ops = model.evaluate_ops(lay)
    _, _, owned = model.ranks.geometry(lay.pp, lay.chunks, lay.v_shaped)
    ranks = [tuple(sum(ops[s][k] for s in own) for k in range(3)) for own in owned]
    unit = max(f for f, _, _ in ranks)
    text = ";".join(",".join(f"{x / unit:.3g}" for x in rank) for rank in ranks)
    return f"{text},{model.send_time(lay) / unit:.3g}"


__all__ = ["CostModel", "StepCost", "search_costs"]
