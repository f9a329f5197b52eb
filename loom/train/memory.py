"""Per-rank memory before launch: parameters, gradients, optimizer state and activations.

``estimate_memory(config)`` predicts the bytes each rank will hold for any layout (pp, dp_replicate,
dp_shard with ZeRO stage 1/2/3, cp, tp with or without SP and vocabulary parallelism), compute dtype,
recomputation policy and pipeline schedule, and reports the worst rank. ``loom estimate-memory``
prints it; ``loom train`` refuses a layout whose estimate exceeds ``train.memory_limit_gb`` (by
default the CUDA device's memory, or on CPU 90% of the host's available memory shared by its local
ranks; ``train.skip_memory_check`` overrides).

Model state (ZeRO §3, Rajbhandari et al. 2020; Ψ = the rank's parameters after TP and PP, d = the
``dp_shard`` degree times ``cp``: ZeRO shards over dp_shard x cp, whose ranks hold the same
weights; ZeRO-1/2 under TP bucket each rank's tp shards, so Ψ is the local count there too;
measured to the byte, docs/benchmarks.md). With ``train.dtype`` = fp32 or bf16_autocast Loom
keeps fp32 parameters (under autocast they *are* the master weights and autocast makes the
bf16 copies), so K = 8 (two AdamW moments) and

=========  ==============  ==============  =================  =================================
ZeRO       parameters      gradients       optimizer (AdamW)  paper, mixed precision (K = 12)
=========  ==============  ==============  =================  =================================
none       4Ψ              4Ψ              8Ψ                 16Ψ
1          4Ψ              4Ψ              8Ψ/d               4Ψ + 12Ψ/d
2          4Ψ              4Ψ/d            8Ψ/d               2Ψ + 14Ψ/d
3          4Ψ/d            4Ψ/d            8Ψ/d               16Ψ/d
=========  ==============  ==============  =================  =================================

The per-rank totals equal the paper's at every stage (4 + 4 + 8 = 2 + 2 + 12); only the split
differs. With ``train.dtype = bf16`` (bf16 parameters, fp32 masters) ZeRO-0/1/2 hold 2Ψ of
parameters, gΨ of gradients (g = 4, or 2 with ``grad_reduce_dtype = bf16``; gΨ/d at ZeRO-2) and
12Ψ (/d at ZeRO-1/2) of masters and moments, the paper's split exactly at g = 2; ZeRO-3 is
FSDP2's and the same as above (``model_state_bytes``' ``master``; measured to the byte,
docs/benchmarks.md). ZeRO-3 adds the gathered (unsharded) parameters of the block in use and of
the prefetched one (compute dtype) as ``transient``.

That is the state at rest. The peak is taken over the instants of a rank's step (during and right
after each action of its pipeline schedule; without a pipeline, F then B per microbatch; then the
optimizer step), each instant adding what Loom's code holds then (``notes`` says which, with the
bytes; ``memory_instants`` lists them all). Against the allocator's measured peak: within 6%
for 8 of 10 layouts with accumulation and pipelines (docs/benchmarks.md "ZeRO memory"):

* gradients full-size while microbatches accumulate (all but the last microbatch run with the
  reducer's ``sync`` off; a pipeline stage's every backward piece does, until the runtime
  flushes it after its last one): ZeRO-2 holds autograd's full ``p.grad`` (4Ψ_stage) beside its
  persistent slice from the stage's first B/W to its flush; ZeRO-3 (FSDP2, sync off) holds each
  unit's unsharded gradient instead of the shard, which only exists after the reduce-scatter
  (fp32, or the compute dtype when the reduction is bf16 too), and a unit's fresh gradient
  beside it until added (one block, ``transient``); ZeRO-1 and plain data parallelism hold
  full gradients anyway;
* ZeRO-3 with ``reshard_after_forward = false``: under a pipeline a stage stays gathered from its
  first F to its flush (required by schedules that split B into I and W, config_rules), without
  one every block from its forward to its backward; either way ``compute x Ψ_stage`` of whole
  parameters on top of the shards, counted in ``parameters`` (and no per-block ``transient``);
* ZeRO-2's reduction (during the last backward; under a pipeline, the stage's flush after its
  last piece): gradients are packed into bucket buffers (``train.grad_bucket_mb``) as they are
  ready and freed, with at most two reduce-scatters outstanding, so at most three buffers are
  held, or one beside autograd's full-size gradients when microbatches accumulated into them
  (they are freed bucket by bucket as they are packed), plus the slices' outputs
  (``transient``). With ``train.grad_reduce_every_microbatch`` ZeRO-2/3 never hold full-size
  gradients: every backward is reduced;
* gradients that ``zero_grad`` frees (plain data parallelism, ZeRO-3; not ZeRO-1's buffer or
  ZeRO-2's slice) are absent before a stage's first backward piece, and at its start only the
  head's exist (a backward makes it first), while every activation is still live;
* the optimizer step: no activations; where AdamW is not fused, its two temporaries (foreach's
  square root of the second moment, then its quotient) the size of the state it steps:
  ``2 x 4Ψ/d`` (``transient``). Loom fuses it (one elementwise kernel, no temporaries) on every
  device type torch has the kernel for, unless the rank's parameter list mixes DTensors and
  plain tensors (``loom.parallel.zero.adamw_kernel``): with tp > 1 and no ZeRO, where the norms
  stay plain without sequence parallelism, an MoE router always, and the embedding and head
  without vocabulary parallelism (``loom.formulas.memory.adamw_step_fused`` predicts it from
  the layout; ZeRO-1/2's flat slices are plain, FSDP2's parameters all DTensors; a dist test
  checks it against the trainer's optimizer). Charging them to the fused step put the estimate
  of 4 layers of Llama-3-8B's shape on an H100 (bf16, seq 2048) 1.27x over the allocator's
  peak; without them 0.96;
* state beside the optimizer's, at every instant (in ``optimizer``): an outer loop's
  (``parallel.dp_mode``) fp32 snapshot and momentum of each parameter the optimizer steps,
  8 bytes (co2: 16, with its displacement and pending average; ``outer_loop_state_bytes``), and
  gradient compression's fp32 residual of each parameter the reducer averages, 4 bytes
  (``compression_residual_bytes``; PowerSGD's small Q not counted). Both measured to the byte
  against the trainer's tensors (tests/dist/test_memory_outer_state.py).

Activations per layer and microbatch (docs/benchmarks.md "Activation memory per layer": Korthikanti
et al. 2022 Table 2 adjusted to Loom's block and measured to the byte; x = s·b·h, e = bytes per
element, f = FFN width, a = query heads, k = key/value heads; s is the cp shard):

* no TP: ``x·e·(8 + 4f/h) + 4sb(2 + a)``; TP: ``x·e·(4 + (4 + 4f/h)/t) + 4sb(2 + a/t)``;
  TP + SP: all of the no-TP bytes over t (``x·e·(2 + (6 + 4f/h)/t) + 4sb(2 + a)/t`` under
  ``train.compile``, whose blocks save the linears' gathered inputs whole); each norm keeps its
  input and rstd (``loom.models.norm``: ``x·e + 4sb``); a GELU MLP
  (``model.mlp = "gelu"``) saves two F-wide tensors instead of SwiGLU's four: 2f/h for 4f/h;
* full recomputation keeps the block input ``x·e`` (plus one block's full set while it is
  recomputed); ``every_k`` does that for every k-th block; selective keeps everything but the
  attention core's own saved tensors (the GQA-repeated k and v and the logsumexp);
* the ends: the head's input and the final norm ``3x·e + 4sb``, the fp32 log-softmax of the
  logits ``4sbV/t`` (vocab parallel; the logits themselves are not kept); at the loss's
  backward, before the head's weight gradient exists, its fp32 gradients ``8sbV`` beside
  them (``F.cross_entropy``: nll_loss's and log_softmax's; the fused vocab-parallel loss's
  softmax clone, ``4sbV/t``), an instant of its own (``loss_backward_bytes``). Counting the
  bf16 logits instead of these put the estimate of 4 layers of Llama-3-8B's shape on an H100
  12% under the allocator's peak at seq 8192;
* all-gather context parallelism (``parallel.cp_mode = "allgather"``): while a layer's
  attention runs, its gathered keys and values ``cp·u·e`` (u = 2·b·(k/t)·s·Hd, one rank's
  stacked pair), in ``transient`` at every instant with activations but the loss's backward
  (``allgather_attention_bytes``; the ring's travelling blocks are not priced);
* in flight: 1 microbatch without a pipeline; the schedule's peak in units of one rank's
  microbatch (``schedule.validate.peak_memory``) with one.

Vocabulary parallelism across the pipeline (``parallel.vocab_parallel_pp``,
``loom.parallel.vocab_pipeline``): the schedule is the one the runtime runs, with its S and T
passes (``vocab_schedule``: 1F1B gains a warm-up forward); every rank holds V/(pp·tp) rows of
the embedding and of the head (one tensor when tied) with their state, the stages neither (the
last ends at the final norm); each microbatch's fp32 exp-logits ``[N, V/(pp·tp)]`` and the
received X live from its S to its T (``vocab_pass_bytes``), a T after the rank's first adds
the rows' fresh gradient, and the m partial embeddings with as many ``[N, D]`` buffers live all
step (``vocab_embedding_bytes``; both ``loom.formulas.memory``'s, the planner's too). Measured
within 6% (docs/benchmarks.md, the last section). With ZeRO on dp_shard the rows' state follows
the stages' rules (ZeRO-1/2: whole rows, optimizer state and ZeRO-2's gradients sliced over
dp_shard), but ZeRO-3's rows are gathered by hand (``GatheredRows``): whole, in the compute
dtype, from the step's start to the embedding's backward after the schedule, with their
unsharded gradients from the rank's first T (the head's) and that backward (the embedding's)
until the one reduce-scatter, whatever ``reshard_after_forward`` says (``StageSpan.gathered``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from loom.config import Config, ConfigError, layout_of
from loom.formulas.memory import (RankStep, StageSpan, StateRules, accumulation_loop,
                                  adamw_step_fused, allgather_attention_bytes,
                                  block_activation_bytes, compression_residual_bytes,
                                  head_activation_bytes, largest_parameter,
                                  loss_backward_bytes, model_state_bytes, optimizer_step_bytes,
                                  outer_loop_state_bytes, rank_state_instants,
                                  vocab_embedding_bytes, vocab_pass_bytes, zero2_bucket_bytes,
                                  zero2_reduction_bytes)
from loom.models.presets import layer_parameter_count
from loom.pipeline.partition import partition_model
from loom.schedule.ir import Action, Op
from loom.schedule.select import schedule_of
from loom.schedule.validate import memory_profile
from loom.schedule.vocab_passes import vocab_schedule

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the worst rank, by component."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    rank: int = 0  # the pipeline rank it describes
    notes: tuple[str, ...] = ()  # what the peak holds beyond the at-rest model state

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.transient

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    def components(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "transient": self.transient}

    def largest(self) -> tuple[str, float]:
        return max(self.components().items(), key=lambda kv: kv[1])

    def table(self) -> str:
        lines = [f"{name:<12} {value / GiB:12.3f} GiB  {value:>16,.0f} B"
                 for name, value in self.components().items()]
        lines.append(f"{'total':<12} {self.total / GiB:12.3f} GiB  {self.total:>16,.0f} B"
                     f"  (pipeline rank {self.rank})")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def layer_activation_bytes(config: Config, *, layer_recomputed: bool = False) -> float:
    """Saved-for-backward bytes of one transformer block for one microbatch on one rank."""
    m, lay, tr = config.model, layout_of(config), config.train
    recompute = "full" if layer_recomputed else ("selective" if lay.recompute == "selective"
                                                 else "none")
    return block_activation_bytes(
        s=config.data.seq_len // lay.cp, b=lay.micro_batch, h=m.dim, f=m.ffn_dim,
        a=m.n_heads, kv=m.n_kv_heads, t=lay.tp, sequence_parallel=lay.sequence_parallel,
        e=2 if tr.dtype != "fp32" else 4, recompute=recompute, compiled=tr.compile,
        gated=m.mlp == "swiglu")


def _head_activation_bytes(config: Config) -> float:
    m, lay, tr = config.model, layout_of(config), config.train
    return head_activation_bytes(s=config.data.seq_len // lay.cp, b=lay.micro_batch, h=m.dim,
                                 vocab=_loss_vocab(config), e=2 if tr.dtype != "fp32" else 4)


def _loss_vocab(config: Config) -> int:
    """The logits' width on one rank: its share under vocabulary parallelism (tp > 1), else
    the whole vocabulary (tp gathers the logits for the plain loss)."""
    lay = layout_of(config)
    return config.model.vocab_size // (lay.tp if lay.vocab_parallel else 1)


def _loss_backward_bytes(config: Config) -> float:
    """``loss_backward_bytes`` of ``config``'s microbatch: the fused vocab-parallel loss
    (``loom.parallel.vocab``) where the logits are vocab-sharded, else ``F.cross_entropy``."""
    lay = layout_of(config)
    return loss_backward_bytes(tokens=config.data.seq_len // lay.cp * lay.micro_batch,
                               vocab=_loss_vocab(config),
                               fused=lay.vocab_parallel and lay.tp > 1)


def attention_transient_bytes(config: Config) -> float:
    """What one layer's attention holds while it runs beyond its saved bytes: all-gather
    context parallelism's gathered keys and values (``allgather_attention_bytes``); 0 for the
    other cp modes (the ring's travelling blocks are not priced) and without cp."""
    m, lay = config.model, layout_of(config)
    if lay.cp == 1 or lay.cp_mode != "allgather":
        return 0.0
    return allgather_attention_bytes(s=config.data.seq_len // lay.cp, b=lay.micro_batch,
                                     kv_heads=m.n_kv_heads / lay.tp, head_dim=m.head_dim,
                                     cp=lay.cp, e=2 if config.train.dtype != "fp32" else 4)


@dataclass(frozen=True)
class _Timeline:
    """A rank's step: its layers, ends, and its stages and live activations through the
    schedule's actions (``RankStep``)."""

    layers: list[int]
    embedding: bool
    head: bool
    step: RankStep
    # vocabulary parallelism across the pipeline: the microbatches whose S has run and T not,
    # during and right after each action (their exp-logits are held), and whether the rank
    # holds the last stage (its X is the stage's output, not a received copy)
    vocab_during: tuple[int, ...] = ()
    vocab_after: tuple[int, ...] = ()
    final_norm: bool = False


def _timelines(config: Config) -> list[_Timeline]:
    """Per pipeline rank, its step as the runtime runs it; without a pipeline, the trainer's
    gradient-accumulation loop (F then B per microbatch, the reduction after the last B)."""
    lay = layout_of(config)
    micro = lay.microbatches
    if lay.pp == 1:
        layers = list(range(config.model.n_layers))
        psi = _parameter_count(config, layers, True, True)
        return [_Timeline(layers, True, True,
                          accumulation_loop(psi, micro, _head_parameters(config)))]
    schedule = schedule_of(lay, max_stages=config.model.n_layers)
    vocab_pp = _vocab_pp(config)
    if vocab_pp:  # the S and T passes where the runtime places them (loom.pipeline.runtime)
        schedule = vocab_schedule(schedule)
    # a schedule with routes (bidirectional_v) holds copies of an L-stage model: stage s is
    # model stage s % L of copy s // L, with its own parameters
    per_route = schedule.stages_per_route
    ranges = partition_model(config.model, per_route, config.data.seq_len,
                             vocab_spread=vocab_pp)
    final = per_route - 1
    out = []
    for rank in range(lay.pp):
        row = schedule.actions[rank]
        ids = schedule.stages_of(rank)
        last_piece = {}  # (stage, microbatch) -> its last backward piece: frees its activations
        for index, action in enumerate(row):
            if action.op in (Op.W, Op.B):
                last_piece[(action.stage, action.microbatch)] = index
        stages = []
        for s in ids:
            forward = [i for i, a in enumerate(row) if a.stage == s and a.op is Op.F]
            weight = [i for i, a in enumerate(row) if a.stage == s and a.op in (Op.B, Op.W)]
            j, first_of_copy = s % per_route, s - s % per_route
            if vocab_pp:  # the stages hold no embedding or head, the last one the final norm
                psi = _parameter_count(config, list(ranges[j]), False, False) + (
                    config.model.dim if j == final else 0)
                stages.append(StageSpan(psi, forward[0], weight[0], weight[-1]))
                continue
            # a tied head on its copy's embedding rank shares its weight (one Parameter)
            psi = _parameter_count(config, list(ranges[j]), j == 0, j == final) - (
                _head_parameters(config)
                if j == final and j != 0 and first_of_copy in ids and config.model.tie_embeddings
                else 0)
            stages.append(StageSpan(psi, forward[0], weight[0], weight[-1],
                                    _head_parameters(config) if j == final else 0.0))
        vocab_during: tuple[int, ...] = ()
        vocab_after: tuple[int, ...] = ()
        if vocab_pp:
            stages.extend(_vocab_spans(config, row))
            vocab_during, vocab_after = _vocab_levels(row)
        during = [float(level) for level in memory_profile(schedule, rank)]
        after = [level - (float(schedule.stage_weight(a.stage))
                          if last_piece.get((a.stage, a.microbatch)) == i else 0.0)
                 for i, (a, level) in enumerate(zip(row, during))]
        out.append(_Timeline([i for s in ids for i in ranges[s % per_route]],
                             not vocab_pp and any(s % per_route == 0 for s in ids),
                             not vocab_pp and any(s % per_route == final for s in ids),
                             RankStep(tuple(stages), tuple(during), tuple(after),
                                      tuple(not vocab_pp and a.op in (Op.B, Op.I)
                                            and a.stage % per_route == final for a in row)),
                             vocab_during, vocab_after,
                             vocab_pp and any(s % per_route == final for s in ids)))
    return out


def _vocab_pp(config: Config) -> bool:
    """Whether the embedding and head are split over the pipeline's ranks
    (``parallel.vocab_parallel_pp``, ``loom.parallel.vocab_pipeline``)."""
    return config.parallel.vocab_parallel_pp and layout_of(config).pp > 1


def _vocab_rows(config: Config) -> float:
    """Parameters of one rank's rows of the embedding (or of the head: as many) under
    vocabulary parallelism across the pipeline: V / (pp x tp) rows of D."""
    m, lay = config.model, layout_of(config)
    return m.vocab_size // (lay.pp * lay.tp) * m.dim


def _vocab_spans(config: Config, row: tuple[Action, ...]) -> list[StageSpan]:
    """The vocabulary shard as the model state sees it: its rows are used from the step's start
    (the embedding's lookup) to its end (the embedding's gradient scatter, after the
    schedule); the head rows' gradients appear at the rank's first T, the embedding's (untied)
    only at that scatter, after the last action. Under ZeRO-3 they are ``gathered`` spans: whole
    (compute dtype) all step and their gradients unsharded until that scatter's reduce-scatter,
    whatever ``reshard_after_forward`` says (``GatheredRows``)."""
    rows, end = _vocab_rows(config), len(row) - 1
    first_t = next(i for i, a in enumerate(row) if a.op is Op.T)
    spans = [StageSpan(rows, 0, first_t, end, gathered=True)]
    if not config.model.tie_embeddings:
        spans.append(StageSpan(rows, 0, end, end, gathered=True))
    return spans


def _vocab_levels(row: tuple[Action, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per action of ``row``, the microbatches whose S has run (or is running) and whose T has
    not finished: during the action and right after it."""
    live, during, after = 0, [], []
    for action in row:
        live += action.op is Op.S
        during.append(live)
        live -= action.op is Op.T
        after.append(live)
    return tuple(during), tuple(after)


def _parameter_count(config: Config, layers: list[int], embedding: bool, head: bool) -> float:
    """Parameters one rank holds after TP (norms and a non-vocab-parallel embedding replicated)."""
    m, lay = config.model, layout_of(config)
    t = lay.tp
    norms = 2 * m.dim
    total = sum((layer_parameter_count(m, i) - norms) / t + norms for i in layers)
    # the routed experts are split over ep as well: this rank keeps n_experts / ep of them
    total -= _expert_parameters(config, layers) * (lay.ep - 1)
    vocab = _head_parameters(config)  # the embedding's rows are as many
    if embedding:
        total += vocab
    if head:
        total += m.dim + (0 if m.tie_embeddings and embedding else vocab)
    return total


def _head_parameters(config: Config) -> float:
    """The output layer's weight on one rank, the embedding's size too (a tied head's is the
    embedding's)."""
    m, lay = config.model, layout_of(config)
    return m.vocab_size * m.dim / (lay.tp if lay.vocab_parallel else 1)


def _expert_parameters(config: Config, layers: list[int]) -> float:
    """Routed-expert parameters one rank holds in ``layers`` (E / ep experts, each split by
    expert-TP = tp), each of the dense MLP's kind (``mlp_matrices`` D x F_e: SwiGLU 3, GELU 2);
    ZeRO shards them over dp_shard (x cp) only, not over ep."""
    m, lay = config.model, layout_of(config)
    if not m.n_experts:
        return 0.0
    expert = m.mlp_matrices * m.dim * (m.expert_ffn_dim or m.ffn_dim)
    return sum(m.n_experts * expert / (lay.ep * lay.tp) for i in layers if m.moe_layer(i))


def _held(config: Config, stage: int) -> bool:
    """ZeRO-3 with ``reshard_after_forward = false``: FSDP2 keeps a unit gathered after its
    forward. Under a pipeline the runtime holds the stage until its flush (after its last backward
    piece: the schedules that split the backward need that, config_rules); without one, every
    block stays gathered from its forward to its backward, so all of them at the end of forward."""
    return stage == 3 and not layout_of(config).reshard_after_forward


def _per_microbatch_activations(config: Config, line: _Timeline) -> float:
    """Saved bytes of one rank's microbatch over its layers and ends (recomputation applied)."""
    lay, tr = layout_of(config), config.train
    if lay.recompute == "full":
        recomputed = set(line.layers)
    elif lay.recompute == "every_k":
        recomputed = {i for i in line.layers if i % lay.recompute_every == 0}
    else:
        recomputed = set()
    per_micro = sum(layer_activation_bytes(config, layer_recomputed=i in recomputed)
                    for i in line.layers)
    if recomputed:  # one block's full set lives again while it is recomputed
        per_micro += layer_activation_bytes(config)
    if line.head:
        per_micro += _head_activation_bytes(config)
    elif line.final_norm:  # vocabulary-parallel: the last stage ends at the final norm
        per_micro += head_activation_bytes(s=config.data.seq_len, b=lay.micro_batch,
                                           h=config.model.dim, vocab=0,
                                           e=2 if tr.dtype != "fp32" else 4)
    if tr.offload_activations and not tr.device.startswith("cpu"):
        per_micro = 0.0
    return per_micro


def _vocab_pass_bytes(config: Config, final: bool) -> float:
    """``vocab_pass_bytes`` of ``config``: N = micro_batch x seq_len / cp tokens (a cp rank's
    part of the sequences), the wire dtype bf16 under ``train.dtype = bf16``, else fp32."""
    m, lay = config.model, layout_of(config)
    tokens = lay.micro_batch * (config.data.seq_len // lay.cp)
    return vocab_pass_bytes(tokens=tokens, vocab=m.vocab_size,
                            shards=lay.pp * lay.tp, h=m.dim,
                            wire=2 if config.train.dtype == "bf16" else 4, final=final)


def _vocab_embedding_bytes(config: Config) -> float:
    """``vocab_embedding_bytes`` of ``config`` (parameters and wire in bf16 under
    ``train.dtype = bf16``, else fp32), over a cp rank's part of the sequences."""
    lay = layout_of(config)
    e = 2 if config.train.dtype == "bf16" else 4
    return vocab_embedding_bytes(microbatches=lay.microbatches,
                                 tokens=lay.micro_batch * (config.data.seq_len // lay.cp),
                                 h=config.model.dim, e=e, wire=e)


def _with_vocab_activations(config: Config, line: _Timeline, per_micro: float) -> RankStep:
    """``line``'s step with the vocabulary passes' bytes added to its levels, in units of
    ``per_micro`` (one rank-microbatch of the stages' activations, the final norm's on the
    last stage): the split embedding's all through the schedule, and each microbatch's
    between its S and T."""
    unit = per_micro or 1.0
    held = _vocab_embedding_bytes(config) / unit
    one = _vocab_pass_bytes(config, line.final_norm) / unit
    # a T after the rank's first makes the head rows' fresh gradient (parameter dtype) before
    # autograd adds it to the accumulated one
    fresh = (2 if config.train.dtype == "bf16" else 4) * _vocab_rows(config) / unit
    step = line.step
    t_passes = [i for i, n in enumerate(line.vocab_during)
                if i < len(line.vocab_after) and n > line.vocab_after[i]]
    later = set(t_passes[1:])
    return RankStep(step.stages,
                    tuple(level + held + n * one + (fresh if i in later else 0.0)
                          for i, (level, n) in enumerate(zip(step.during, line.vocab_during))),
                    tuple(level + held + n * one for level, n in zip(step.after,
                                                                      line.vocab_after)))


def _rank_instants(config: Config, rank: int, line: _Timeline) -> Iterator[MemoryEstimate]:
    """The bytes of one pipeline rank at every instant of its step that can be its peak: the
    model state's instants (``rank_state_instants``) with the live activations beside each."""
    lay, tr, m = layout_of(config), config.train, config.model
    stage = lay.zero_stage
    if tr.dtype == "bf16" and stage < 3:  # bf16 parameters: gradients in the reduction dtype
        grad_bytes = 2 if tr.grad_reduce_dtype == "bf16" else 4
    else:  # FSDP2 accumulates in reduce_dtype when it differs from the compute dtype
        grad_bytes = 2 if stage == 3 and tr.dtype != "fp32" and tr.grad_reduce_dtype == "bf16" \
            else 4
    rules = StateRules(
        shard=lay.dp_shard * lay.cp, ep=lay.ep, stage=stage,
        compute_bytes=2 if tr.dtype != "fp32" else 4, grad_bytes=grad_bytes,
        master=tr.dtype == "bf16",
        accumulates=stage in (2, 3) and not tr.grad_reduce_every_microbatch,
        held=_held(config, stage), pipelined=lay.pp > 1,
        block=max((layer_parameter_count(m, i) for i in line.layers), default=0.0) / lay.tp,
        largest=4 * largest_parameter(m, lay.tp, lay.ep, lay.vocab_parallel),
        bucket_bytes=tr.grad_bucket_mb * 2**20,
        offloaded=bool(tr.offload_optimizer and stage and not tr.device.startswith("cpu")),
        # ZeRO-1's accumulation buffer and ZeRO-2's reduced slice outlive the step; the others
        # are freed by zero_grad (set_to_none)
        resting_grads=stage in (1, 2),
        # the fused kernel's step allocates no temporaries; the rule is the optimizer builder's
        fused_step=adamw_step_fused(
            tr.device, tp=lay.tp, zero_stage=stage, sequence_parallel=lay.sequence_parallel,
            vocab_parallel=lay.vocab_parallel, moe=_expert_parameters(config, line.layers) > 0,
            ends=bool(line.embedding or line.head), vocab_parallel_pp=lay.vocab_parallel_pp))
    psi = _parameter_count(config, line.layers, line.embedding, line.head)
    per_micro = _per_microbatch_activations(config, line)
    step = line.step
    if line.vocab_during:  # the rows are the rank's parameters too; their passes' bytes
        psi = sum(st.psi for st in step.stages)
        step = _with_vocab_activations(config, line, per_micro)
        per_micro = per_micro or 1.0  # the levels above are in its units
    # what a backward has freed once the head and the top block are done
    head_and_top = ((_head_activation_bytes(config) if line.head else 0.0)
                    + layer_activation_bytes(config, layer_recomputed=lay.recompute == "full"))
    # a layer's attention buffers, at every instant with activations at which one can run
    # (not the loss's backward, nor the end of the top block's backward, nor the optimizer step)
    attention = attention_transient_bytes(config) if line.layers else 0.0
    attention_note = (f"all-gather CP: one layer's gathered keys and values,"
                      f" {attention:,.0f} B in 'transient'",)
    instants = list(rank_state_instants(psi, _expert_parameters(config, line.layers), step,
                                        rules))
    # beside the optimizer: the outer loop's state of every parameter the optimizer steps (its
    # moments' count: 8 bytes each, 12 with bf16 parameters' masters below ZeRO-3; 0 when the
    # state is on the host) and compression's residuals of every parameter the reducer averages
    per_owned = 12 if rules.master and stage < 3 else 8
    owned = max(i.optimizer for i in instants) / per_owned
    beside = (outer_loop_state_bytes(owned, config.parallel.dp_mode)
              + compression_residual_bytes(psi, config.parallel.grad_compression))
    beside_note = ((f"outer loop ({config.parallel.dp_mode}) and compression state:"
                    f" {beside:,.0f} B in 'optimizer'",) if beside else ())
    for instant in instants:
        live = max(0.0, per_micro - head_and_top) if instant.less_head_and_top else per_micro
        loss = _loss_backward_bytes(config) if instant.loss and line.head else 0.0
        extra = attention if (instant.level and not instant.loss
                              and not instant.less_head_and_top) else 0.0
        yield MemoryEstimate(instant.parameters, instant.gradients, instant.optimizer + beside,
                             live * instant.level + loss, instant.transient + extra, rank,
                             instant.notes + beside_note
                             + (attention_note if extra else ()))


def estimate_memory(config: Config) -> MemoryEstimate:
    """The worst pipeline rank's bytes for a resolved config (see the module docstring): the
    largest total over the instants of the rank's step (during and after each action, ZeRO-2's
    reduction, the optimizer step), with the components as they are at that instant."""
    return max(memory_instants(config), key=lambda estimate: estimate.total)


def memory_instants(config: Config) -> list[MemoryEstimate]:
    """Every instant ``estimate_memory`` weighs, rank by rank in step order: during and right
    after each action (ZeRO-2's reduction after a stage's last backward piece), then the
    optimizer step."""
    return [estimate for rank, line in enumerate(_timelines(config))
            for estimate in _rank_instants(config, rank, line)]


HOST_MEMORY_SHARE = 0.9  # of the host's available memory, for a CPU device's ranks together


def host_available_bytes() -> float:
    """The host's available memory: ``MemAvailable`` of /proc/meminfo (Linux), else free pages
    (``os.sysconf``); 0 when neither is known."""
    import os

    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return 0.0


def _on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def device_limit_bytes(config: Config, local_ranks: int = 1) -> float:
    """Bytes one rank may hold: ``train.memory_limit_gb``; when it is 0, the CUDA device's
    memory, or on a CPU device 90% of the host's available memory split over the host's
    ``local_ranks`` (they share it); 0: no limit known."""
    if config.train.memory_limit_gb > 0:
        return config.train.memory_limit_gb * GiB
    device = config.train.device
    if _on_cpu(device):
        return HOST_MEMORY_SHARE * host_available_bytes() / max(1, local_ranks)
    if device.startswith("cuda") or device == "auto":
        import torch

        if torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else 0
            return float(torch.cuda.get_device_properties(index).total_memory)
    return 0.0


def check_memory_limit(config: Config, local_ranks: int = 1) -> str | None:
    """None when the estimate fits (or no limit is known, or ``train.skip_memory_check`` /
    ``train.ignore_memory_limit`` is set); else the refusal, a ConfigError's message naming the
    field, the estimate and its largest component. On a CPU device the ``local_ranks`` of this
    host share its memory: the peak per rank x local_ranks is what must fit."""
    tr = config.train
    if tr.skip_memory_check or tr.ignore_memory_limit:
        return None
    limit = device_limit_bytes(config, local_ranks)
    if limit <= 0:
        return None
    estimate = estimate_memory(config)
    if estimate.total <= limit:
        return None
    name, value = estimate.largest()
    notes = "".join(f" Note: {note}." for note in estimate.notes)
    if tr.memory_limit_gb > 0:
        field, setting, against = ("train.memory_limit_gb", tr.memory_limit_gb,
                                   f"the limit {limit / GiB:.2f} GiB")
    elif _on_cpu(tr.device):
        field, setting = "train.skip_memory_check", False
        against = (f"the limit {limit / GiB:.2f} GiB ({HOST_MEMORY_SHARE:.0%} of the host's"
                   f" {host_available_bytes() / GiB:.2f} GiB available memory, shared by"
                   f" {max(1, local_ranks)} local rank(s))")
    else:
        field, setting, against = ("train.skip_memory_check", False,
                                   f"the device's {limit / GiB:.2f} GiB")
    return str(ConfigError(field, setting, (
        f"estimated peak memory {estimate.total / GiB:.2f} GiB per rank (pipeline rank"
        f" {estimate.rank}) exceeds {against}; largest component:"
        f" {name} {value / GiB:.2f} GiB ({100 * value / estimate.total:.0f}%).{notes}"
        f" Shard more (parallel.dp_shard, zero_stage), recompute (train.recompute) or pass"
        f" --train.skip_memory_check=true")))

__all__ = ["MemoryEstimate", "estimate_memory", "memory_instants", "layer_activation_bytes",
           "check_memory_limit", "block_activation_bytes", "head_activation_bytes",
           "model_state_bytes", "zero2_reduction_bytes", "zero2_bucket_bytes", "largest_parameter",
           "optimizer_step_bytes", "device_limit_bytes", "vocab_pass_bytes", "loss_backward_bytes",
           "vocab_embedding_bytes", "attention_transient_bytes", "GiB"]
