"""The per-rank memory formulas of one layer, the head, the ZeRO model state and the step's
transient buffers, and the instants of a rank's step at which the model state can peak
(``rank_state_instants``): pure functions of sizes, shared by the launch-time estimator
(``loom.train.memory``, which walks the runtime's schedule) and the planner
(``loom.sim.cost_memory``, which walks a rank's last microbatch), so the two differ only in the
timeline they give, not in the rules. Ground floor: imports nothing of Loom and no torch. The
derivations and measurements are in ``loom.train.memory``'s docstring and docs/benchmarks.md.
Communicates nothing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The data-parallel gradient reducers' bucket size (``loom.parallel.data``; ZeRO-2's packing
# buffers too) and ZeRO-2's outstanding reduce-scatters (``loom.parallel.zero``). Here, at the
# ground floor, because the memory formulas depend on them and the reducers import them.
# MAX_IN_FLIGHT = 2 overlaps one bucket's reduction with the next one's packing (DeepSpeed's
# double buffer) and bounds the packed gradients held to three buckets.
BUCKET_BYTES = 25 * 2**20
MAX_IN_FLIGHT = 2


def block_activation_bytes(*, s: int, b: int, h: int, f: float, a: int, kv: int, t: int = 1,
                           sequence_parallel: bool = False, e: int = 4,
                           recompute: str = "none", compiled: bool = False,
                           gated: bool = True) -> float:
    """Saved-for-backward bytes of one transformer block for one microbatch on one rank.

    ``s`` is the rank's sequence shard (after cp), ``f`` the FFN width (an MoE layer passes its
    effective width, see ``loom.sim.cost_model``), ``recompute`` one of none, selective, full
    (the block recomputed: only its input is kept). The formulas: ``loom.train.memory``'s docstring.
    Under SP everything is split t ways (``loom.parallel.sequence_saved`` keeps the linears'
    gathered inputs as the rank's slice) except in a ``compiled`` block, which saves them whole.
    The MLP's F-wide saved tensors: four for SwiGLU (``gated``: w1's and w3's outputs, silu's,
    their product), two for GELU (its input, w1's output, and its output, w2's input; Korthikanti
    et al. 2022 §4.1); its D-wide input is counted with the rest either way.
    """
    x = s * b * h
    if recompute == "full":
        return x * e
    wide = (4 if gated else 2) * f / h  # the MLP's F-wide saved tensors, in units of x
    # two norms (input and rstd each, loom.models.norm), the q/k/v and w1/w3 inputs (2x), the
    # attention's four (q, repeated k and v, output) and its logsumexp, the MLP's F-wide ones
    if t == 1:
        full = x * e * (8 + wide) + 4 * s * b * (2 + a)
    elif sequence_parallel:
        inputs = 2 * x * e * (1 if compiled else 1 / t)  # the q/k/v and w1/w3 input
        full = inputs + x * e * (6 + wide) / t + 4 * s * b * (2 + a) / t
    else:
        full = x * e * (4 + (4 + wide) / t) + 4 * s * b * (2 + a / t)
    if recompute == "selective":  # the core's own: repeated k, v beyond q's inputs; lse
        full -= (2 * x * e * (1 - kv / a) + 4 * s * b * a) / t
    return full


def recomputed_fraction(recompute: str, every: int, n_layers: int) -> float:
    """The fraction of a model's blocks recomputed in backward: all under ``full``, blocks
    0, k, 2k, ... under ``every_k`` (k = ``every``; ``loom.train.memory`` and the trainer pick
    the same ones), none otherwise (``selective`` recomputes the attention core, not blocks).
    The planner spreads it evenly over a pipeline's stages."""
    if recompute == "full":
        return 1.0
    if recompute == "every_k" and n_layers > 0:
        return -(-n_layers // max(1, every)) / n_layers
    return 0.0


def op_sac_block_bytes(*, s: int, b: int, h: int, f: float, a: int, kv: int, t: int = 1,
                       sequence_parallel: bool = False, e: int = 2, gated: bool = True) -> float:
    """Saved bytes of one Llama block for one microbatch under torchtitan's op-level selective
    checkpointing: the block's input (the checkpoint's), and the outputs of the matmuls it
    numbers 1, 3, 5 and 7 (wq, wv, w1 and, in a SwiGLU MLP, w2; a GELU MLP's w2 is its 6th and
    recomputed) and of the attention kernel (its output and fp32 logsumexp); everything else
    (norms, RoPE, SiLU and the product, residual adds, the even matmuls wk, wo and w3) runs
    again in backward. Under tensor parallelism every matmul output is the rank's shard, but
    w2's, a row-parallel matmul's partial sums, is whole; under sequence parallelism the input
    is the rank's slice and the reduce-scatters' outputs, also kept, add two slices."""
    x = s * b * h
    sp = sequence_parallel and t > 1
    kept = x * e / (t if sp else 1)  # the block's input
    kept += x * e / t + x * e * kv / (a * t)  # wq's and wv's outputs
    kept += x * e / t + 4 * s * b * a / t  # the attention's output and logsumexp
    kept += s * b * f * e / t + (x * e if gated else 0.0)  # w1's, and a SwiGLU w2's
    if sp:
        kept += 2 * x * e / t  # the two reduce-scatters' outputs
    return kept


def op_sac_recomputed_flops(*, tokens: float, h: int, f: float, a: int, kv: int,
                            t: int = 1) -> float:
    """The matmul FLOPs torchtitan's op-level selective checkpointing runs again per block and
    microbatch on one rank: its even matmuls, wk, wo and one of the MLP's h x f matrices
    (``op_sac_block_bytes``)."""
    return 2 * tokens * h * (h * kv / a + h + f) / t


def block_weight_grad_bytes(*, s: int, b: int, h: int, f: float, a: int, kv: int,
                            e: int = 4, gated: bool = True) -> float:
    """What one block (no tp) still holds between its input-gradient step I and its weight-gradient
    step W (Zero Bubble's M_W; the freeing split of ``loom.pipeline.stage``): each linear's input
    and its output's gradient. Inputs: both norms' outputs (one each for q/k/v and for w1/w3), the
    attention output, the SwiGLU product (3h + f); gradients: q, k, v, wo's and w2's outputs,
    w1's and w3's (3h + 2h·kv/a + 2f; a GELU MLP, not ``gated``, has w1's only: f).
    ``weight_grad_fraction`` = this / ``block_activation_bytes`` (0.73 for h = 256, f = 3h,
    kv = a/2)."""
    return s * b * e * (6 * h + 2 * h * kv / a + (3 if gated else 2) * f)


def head_activation_bytes(*, s: int, b: int, h: int, vocab: int, e: int = 4) -> float:
    """The head's saved bytes for one microbatch: final norm (input, output, rstd) and the
    loss's fp32 log-probabilities ``[s·b, vocab]`` (``vocab`` is the rank's share of the
    vocabulary; the fused vocab-parallel loss saves its softmax, as many). Not the logits: the
    output layer saves its input, the fp32 upcast and log-softmax do not keep theirs, and the
    stage drops its reference once the loss is computed (``loom.pipeline.stage``)."""
    return 2 * s * b * h * e + 4 * s * b + 4 * s * b * vocab


def loss_backward_bytes(*, tokens: int, vocab: int, fused: bool = False) -> float:
    """What the cross entropy's backward holds beyond its saved fp32 log-probabilities
    (``head_activation_bytes``), at its largest instant, for ``tokens`` rows of ``vocab`` (the
    rank's share) logits. ``F.cross_entropy`` (log_softmax, then nll_loss; the plain head):
    nll_loss's gradient ``[tokens, vocab]`` in fp32 and log_softmax's backward output, the
    logits' fp32 gradient, beside the saved log-probabilities: 8 bytes per logit (12 with
    them). ``fused`` (``loom.parallel.vocab``'s vocab-parallel loss): its clone of the saved
    softmax, scaled in place: 4. Later instants hold less: the logits' gradient cast to the
    compute dtype beside the fp32 one (then the log-probabilities are freed), and the head's
    weight gradient, which does not exist yet at this instant. The forward's largest (logits,
    their fp32 copy and the log-probabilities: 10 bytes in bf16) is smaller too. Measured to
    the allocation on CPU (``bench/zero_memory.py --loss-path``)."""
    return (4 if fused else 8) * tokens * vocab


def allgather_attention_bytes(*, s: int, b: int, kv_heads: float, head_dim: int, cp: int,
                              e: int = 4) -> float:
    """What all-gather context parallelism (``loom.parallel.allgather_attention``) holds while
    one layer's attention runs, beyond the block's saved bytes and beyond the ring, whose
    travelling blocks (like both modes' per-block temporaries) are not priced: the gathered
    keys and values ``[cp, 2, B, K/tp, s, Hd]`` in the compute dtype, ``cp·u·e`` with
    ``u = 2·B·(K/tp)·s·Hd`` one rank's stacked pair (``s`` the rank's sequence shard,
    ``kv_heads`` its K/tp heads, ``e`` bytes). One layer at a time: the forward frees the buffer
    and the backward gathers it again.

    The backward's fp32 dK/dV blocks are not counted: while they are made it holds ``cp`` of
    them (the ring's relay as many or more: its own, those sent, the one received); only the
    final ``torch.stack`` instant holds ``4(cp-1)·u`` more than the ring's last instant, and
    there without the per-block temporaries (the heads repeated in fp32, the block's dQ, dK,
    dV), which outweigh it at cp 2 (unmeasured at larger cp). Measured
    (``bench/zero_memory.py --cp-allgather``: cp 2, 2048 tokens a rank, 4 key/value heads of
    32, so ``cp·u·e`` = 4 MiB in fp32, 2 MiB in bf16): the step's peak exceeds the ring's by
    2 MiB in fp32, 0 to 2 MiB in bf16 from run to run."""
    return cp * 2 * b * kv_heads * s * head_dim * e


def vocab_pass_bytes(*, tokens: int, vocab: int, shards: int, h: int, wire: int = 4,
                     final: bool = False) -> float:
    """What one microbatch holds on a pipeline rank between its S and T under vocabulary
    parallelism across the pipeline (``loom.parallel.vocab_pipeline.OutputPass``): the shard's
    exp(logits - row max) ``[tokens, vocab/shards]`` in fp32 (``shards`` = pp x tp), and X as
    received (``wire`` bytes) unless the rank holds the last stage (``final``: its X is its
    own output, counted with the final norm)."""
    return 4 * tokens * (vocab // shards) + (0 if final else wire * tokens * h)


def vocab_embedding_bytes(*, microbatches: int, tokens: int, h: int, e: int = 4,
                          wire: int = 4) -> float:
    """What every pipeline rank holds all step for the embedding split across the pipeline:
    its partial embedding of every microbatch (``e`` bytes, kept for the gradient scatter after
    the schedule) and as many ``[tokens, h]`` buffers in ``wire`` bytes (the first stage's
    summed inputs not yet run or their gradients come back; the other ranks' posted receives
    of those gradients)."""
    return microbatches * tokens * h * (e + wire)


def model_state_bytes(psi: float, shard: int, stage: int, *, accumulating: bool = False,
                      grad_bytes: int = 4, master: bool = False) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes for ``psi`` parameters under ZeRO ``stage`` (0:
    none) over ``shard`` ranks, with fp32 parameters and gradients and two AdamW moments.

    ``accumulating``: the gradients while microbatches accumulate, before the reduction after the
    last backward: ZeRO-2 holds autograd's full-size ``p.grad`` beside its persistent slice,
    ZeRO-3 (FSDP2) the unsharded gradients (``grad_bytes`` per element) instead of the shards;
    ZeRO-1 and plain data parallelism hold full-size gradients anyway.

    ``master`` (``train.dtype = bf16``): 2-byte parameters, gradients of ``grad_bytes`` (the
    reduction dtype: the fp32 ``main_grad`` or bucket, or bf16), and the optimizer's fp32
    masters counted with its moments (12 bytes, sharded at ZeRO-1/2: the distributed
    optimizer). ZeRO-3 is FSDP2's: its sharded fp32 parameters are the masters, its sharded
    gradients fp32, so the same as fp32's. ZeRO-1: 2Ψ + gΨ + 12Ψ/d; ZeRO-2: 2Ψ + gΨ/d + 12Ψ/d
    (g = 2 gives the ZeRO paper's 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N)."""
    d = shard if stage else 1
    if master and stage < 3:
        grads = grad_bytes * psi / (d if stage == 2 else 1)
        if accumulating and stage == 2:
            grads += grad_bytes * psi  # the full-size main_grad (bf16: p.grad) until packed
        return 2 * psi, grads, 12 * psi / d
    grads = 4 * psi / (d if stage >= 2 else 1)
    if accumulating and stage == 2:
        grads += 4 * psi
    elif accumulating and stage == 3:
        grads = grad_bytes * psi
    return (4 * psi / (d if stage == 3 else 1), grads, 8 * psi / (d if stage >= 1 else 1))


def zero2_bucket_bytes(psi: float, bucket_bytes: float | None = None,
                       largest: float = 0.0) -> float:
    """One ZeRO-2 packing buffer of ``psi`` parameters' gradients: a bucket closes once it holds
    ``bucket_bytes`` (default ``BUCKET_BYTES``), so it is at most one parameter (``largest``
    bytes) bigger, and never bigger than all of them."""
    return min(4 * psi, (BUCKET_BYTES if bucket_bytes is None else bucket_bytes) + largest)


def zero2_reduction_bytes(psi: float, shard: int, *, accumulated: bool,
                          bucket_bytes: float | None = None, largest: float = 0.0
                          ) -> tuple[float, float]:
    """(gradients, transient) at ZeRO-2's reduction of ``psi`` parameters' gradients
    (``loom.parallel.zero``: each gradient packed into its bucket's buffer and freed, at most
    ``MAX_IN_FLIGHT`` reduce-scatters outstanding). ``accumulated``: autograd's full-size
    ``p.grad`` exists when the reduction starts (microbatches accumulated with ``sync`` off, or a
    pipeline stage's flush): 4Ψ, freed bucket by bucket as packed, so one packing buffer beside
    it; otherwise up to ``MAX_IN_FLIGHT + 1`` buffers. Transient: those buffers (a bucket closes
    at ``bucket_bytes`` or one parameter, at most ``largest`` bytes, beyond) and the reduced
    slices' outputs (4Ψ/d)."""
    bucket = zero2_bucket_bytes(psi, bucket_bytes, largest)
    buffers = bucket if accumulated else min(4 * psi, (MAX_IN_FLIGHT + 1) * bucket)
    return (4 * psi if accumulated else 0.0), buffers + 4 * psi / shard


# fp32 values ``loom.parallel.outer`` keeps per parameter its optimizer steps: the snapshot and
# the momentum; co2 also the last displacement and the pending (stale) average
OUTER_STATE_BYTES = {"sync": 0, "diloco": 8, "noloco": 8, "co2": 16}


def outer_loop_state_bytes(owned: float, mode: str) -> float:
    """Bytes of the outer loop's state (``parallel.dp_mode``) for ``owned`` parameters: those
    the rank's optimizer steps (ZeRO-1/2's slices, ZeRO-3's shards, otherwise all), which are
    what ``OuterLoop`` snapshots. fp32 whatever the parameters' dtype."""
    return OUTER_STATE_BYTES[mode] * owned


def compression_residual_bytes(psi: float, method: str) -> float:
    """Bytes of gradient compression's error feedback (``parallel.grad_compression``): an fp32
    residual for each of the ``psi`` parameters the data-parallel reducer averages (compression
    runs without ZeRO, so all of the rank's). PowerSGD's warm-start Q (columns x rank per
    matrix, a few percent of the residual's bytes at the ranks it runs) is not counted."""
    return 0.0 if method == "none" else 4 * psi


def optimizer_step_bytes(psi: float, shard: int, stage: int) -> float:
    """Transient bytes of an unfused optimizer step: torch's foreach AdamW allocates two
    temporaries the size of the state it steps (the square root of the second moment, then its
    quotient), this rank's slice under ZeRO (``stage`` > 0) and all ``psi`` parameters without.
    The fused kernel allocates none (``adamw_step_fused`` says when Loom's step is fused)."""
    return 2 * 4 * psi / (shard if stage else 1)


# Device types with a fused AdamW kernel in torch (``_get_fused_kernels_supported_devices``; a
# unit test checks every one is torch's); ``loom.parallel.zero.adamw_kernel`` asks torch itself
FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")


def adamw_step_fused(device: str, *, tp: int, zero_stage: int, sequence_parallel: bool,
                     vocab_parallel: bool, moe: bool = False, ends: bool = True,
                     vocab_parallel_pp: bool = False) -> bool:
    """Whether a rank's AdamW step runs torch's fused kernel, predicted from its layout:
    ``loom.parallel.zero.adamw_kernel`` fuses a parameter list on a ``device`` type with the
    kernel unless it mixes DTensors and plain tensors, and only tensor parallelism without ZeRO
    (``zero_stage`` 0) gives such a list: ZeRO-1/2 step plain flat slices, FSDP2 (ZeRO-3) makes
    every parameter a DTensor. Under tp > 1 the block's linears are DTensors, while these stay
    plain: the norms without sequence parallelism, an MoE router (``moe``), and on a rank
    holding the embedding or the head (``ends``) those two without ``vocab_parallel``. The
    split embedding and head of ``vocab_parallel_pp`` are counted as mixed (an upper bound).
    Fused, the step allocates no temporaries; otherwise ``optimizer_step_bytes``."""
    if device != "auto" and device.split(":")[0] not in FUSED_ADAMW_DEVICES:
        return False  # "auto" is a GPU or the CPU: both fused
    if tp == 1 or zero_stage:
        return True
    return not (moe or not sequence_parallel or vocab_parallel_pp
                or (ends and not vocab_parallel))


def largest_parameter(m: Any, tp: int = 1, ep: int = 1, vocab_parallel: bool = True) -> float:
    """Elements of one rank's largest parameter tensor of model ``m`` (``TransformerArgs``): a
    gradient bucket closes at most this far past its size."""
    experts = (m.n_experts / ep) * m.dim * (m.expert_ffn_dim or m.ffn_dim) / tp \
        if m.n_experts else 0.0
    return max(m.vocab_size * m.dim / (tp if vocab_parallel else 1), m.dim * m.ffn_dim / tp,
               m.dim * m.n_heads * m.head_dim / tp, experts)


def korthikanti_block_activation_bytes(*, s: int, b: int, h: int, f: float, a: int, kv: int,
                                       t: int = 1, sequence_parallel: bool = False,
                                       sp_shards_all: bool = True, e: int = 2,
                                       recompute: str = "none", flash: bool = True,
                                       dropout: bool = False, gated: bool = True,
                                       scores_bytes: float | None = None,
                                       norm_outputs: bool = False,
                                       eager_copies: bool = False) -> float:
    """Saved-for-backward bytes of one block as Megatron-style stacks keep them (Korthikanti et
    al. 2022, §4.1, generalised to GQA, gated MLPs, flash attention and blocks without dropout),
    for the planner's framework profiles (``loom.sim.frameworks``); Loom's own trainer is
    ``block_activation_bytes``.

    With x = s·b·h elements: the two norms' inputs (2e·x), the QKV input (e·x), Q (e·x), K and V
    (2e·x·kv/a), the output projection's input (e·x), the MLP's input (e·x) and its inner
    activations (gated: both branches and their product, 3e·s·b·f; GELU: its input and output,
    2e·s·b·f), and with ``dropout`` two 1-byte masks (2x) — 34·s·b·h for a GPT block at e = 2,
    f = 4h. The attention core adds the s x s probabilities without a ``flash`` kernel
    ((e + (e + 1 if dropout else 0))·a·s²·b: 5·a·s²·b at e = 2 with dropout), the fp32
    log-sum-exp (4·s·b·a) with one. Tensor parallelism splits everything but the norms' inputs,
    the QKV and MLP inputs and the masks (10·s·b·h replicated for GPT); sequence parallelism
    splits those too when ``sp_shards_all`` (Megatron), otherwise it keeps the QKV and MLP inputs
    (the all-gathered ones) whole. ``recompute``: "selective" drops the s x s part (the core is
    recomputed), "full" keeps only the block's input (split under sequence parallelism).

    Knobs for stacks that keep more (``loom.sim.frameworks``, Aleph Alpha's Scaling):
    ``scores_bytes``, the bytes a non-flash core written out in PyTorch ops saves per s x s
    element of each head instead of the above (``unfused_scores_bytes``), beside the boolean
    mask ``masked_fill_`` saves once for all the heads (s²·b bytes, on every tp rank);
    ``norm_outputs``, each RMSNorm written as eager ops the way Llama's reference code writes
    it (``_norm(x.float()).type_as(x) * weight``) saves the fp32 copy of its input (for the
    square and the scaling) and its output (for the weight's gradient) in place of its input:
    (4 + e)·x per norm where e < 4 (in fp32 the copy is the input: 2e·x), split like the norms'
    inputs; ``eager_copies``, a block of eager PyTorch ops in Megatron's [s, b, h] layout also
    saves SwiGLU's ``silu(x)`` (the product's operand; a fused SwiGLU recomputes it: e·s·b·f)
    and, with a flash kernel, the attention output twice (the kernel's [b·s, heads, d] output
    and the output projection's input reshaped back to [s, b, h]: e·x), both split by t."""
    x = s * b * h
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return x * e / (t if sp else 1)
    masks = 2 * x if dropout else 0.0
    norms, inputs = 2 * e * x, 2 * e * x  # the norms' inputs; the QKV and MLP inputs
    split = e * x * (1 + 2 * kv / a + 1) + (3 if gated else 2) * e * s * b * f  # Q, K, V, proj in
    if eager_copies:
        split += (e * s * b * f if gated else 0.0) + (e * x if flash else 0.0)
    attention_mask = 0.0  # a written-out core's [b, 1, s, s] boolean mask, whole on each rank
    if flash:
        core = 4 * s * b * a
    elif recompute == "selective":
        core = 0.0
    elif scores_bytes is not None:
        core = scores_bytes * a * s * s * b
        attention_mask = s * s * b
    else:
        core = (e + (e + 1 if dropout else 0)) * a * s * s * b
    if norm_outputs:  # each norm's fp32 copy of its input and its output, not its input
        norms = 2 * (max(e, 4) + e) * x
    if not sp:
        replicated = norms + inputs + masks
    elif sp_shards_all:
        replicated = 0.0
    else:
        replicated = inputs
    return replicated + attention_mask + (norms + inputs + masks - replicated + split + core) / t


def framework_state_bytes(psi: float, shard: int, stage: int, *, param_bytes: int,
                          grad_bytes: int, optimizer_bytes: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes of ``psi`` parameters under ZeRO ``stage`` over
    ``shard`` ranks for a stack holding ``param_bytes`` / ``grad_bytes`` / ``optimizer_bytes``
    per parameter (``loom.sim.frameworks``): stage 1 shards the optimizer state (Megatron's
    distributed optimizer), 2 also the gradients, 3 also the parameters. Full-size gradients
    stay through accumulation below stage 3, as Megatron's and DeepSpeed's buffers do."""
    d = shard if stage else 1
    return (param_bytes * psi / (d if stage == 3 else 1),
            grad_bytes * psi / (d if stage >= 2 else 1),
            optimizer_bytes * psi / d)


def unfused_scores_bytes(*, e: int = 2, softmax_in_fp32: bool = False,
                         dropout: bool = False) -> float:
    """Bytes per s x s element that attention written out in PyTorch ops saves for backward
    (Aleph Alpha's Scaling, ``MaskedSoftmaxTorch``: scores, ``masked_fill_`` with a dense
    boolean mask, softmax, a cast back, a batched matmul with V): the probabilities the matmul
    reads (e); with ``softmax_in_fp32`` the scores are upcast first, so the softmax saves its
    fp32 output (4) beside the cast copy the matmul saves; ``dropout`` adds a 1-byte mask and
    its output (e). In bf16: 2 bytes, 6 with the fp32 softmax. The boolean mask
    ``masked_fill_`` saves is [b, 1, s, s], one byte per element for all the heads
    (``korthikanti_block_activation_bytes`` adds it with ``scores_bytes``). Megatron's fused
    scale-mask-softmax saves only its e-byte output (that function's default)."""
    return e + (4 if softmax_in_fp32 else 0) + (e + 1 if dropout else 0)


def gathered_logits_bytes(*, tokens: int, vocab: int, e: int = 2) -> float:
    """What a head that all-gathers its logits over tensor parallelism and takes the loss on the
    whole vocabulary holds beyond the saved fp32 log-probabilities (``head_activation_bytes``
    with the whole ``vocab``), at the loss's backward: the gathered logits in the compute dtype
    (the pipeline keeps the last stage's output until its backward: e bytes per logit) and the
    cross entropy's backward (``loss_backward_bytes``: 8). Aleph Alpha's Scaling:
    ``ColumnParallelLinear(parallel_output=False)`` concatenates the shards, and
    ``CrossEntropyLoss`` upcasts them to fp32 for ``F.cross_entropy``. ``tokens``: the
    microbatch's s·b."""
    return (e + 8) * tokens * vocab


def bucket_allreduce_bytes(psi: float, *, grad_bytes: int = 2,
                           bucket_elements: float = 500_000_000) -> float:
    """The data-parallel all-reduce's transient when gradients held in a 16-bit dtype are
    reduced in fp32 a bucket at a time (Aleph Alpha's Scaling, ``allreduce_no_retain``: the
    bucket is flattened, then copied to fp32 for the all-reduce; 5·10^8 elements by default, at
    most the rank's ``psi`` parameters): (grad_bytes + 4) bytes per bucket element."""
    return (grad_bytes + 4) * min(psi, bucket_elements)


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage a rank holds: its parameters and when (indices of the rank's actions)
    it is first run forward, first produces weight gradients (B or W) and runs its last backward
    piece (after which it is flushed: gradients reduced, a held ZeRO-3 stage resharded).
    ``early``: its parameters whose gradients a backward makes first (the head's).
    ``gathered``: under ZeRO-3 it is whole from its first F to its last piece and its gradients
    unsharded from its first weight gradient to then, whatever ``StateRules.held`` and
    ``accumulates`` say: the vocabulary rows of ``parallel.vocab_parallel_pp``
    (``loom.parallel.vocab_pipeline.GatheredRows``: all-gathered at the step's start, held,
    reduce-scattered once after the embedding's backward)."""

    psi: float
    first_f: int
    first_w: int
    last: int
    early: float = 0.0
    gathered: bool = False


@dataclass(frozen=True)
class RankStep:
    """A rank's step as memory sees it: its stages, and the live activation units (in one
    rank-microbatch's units) during each action and right after it."""

    stages: tuple[StageSpan, ...]
    during: tuple[float, ...]
    after: tuple[float, ...]
    # per action, whether it runs the loss's backward (a B or I of the stage computing it):
    # an instant then holds ``loss_backward_bytes`` before the head's weight gradient exists
    loss: tuple[bool, ...] = ()


def accumulation_loop(psi: float, microbatches: int, early: float = 0.0) -> RankStep:
    """The step without a pipeline: F then B per microbatch (the reduction after the last B)."""
    n = max(1, microbatches)
    return RankStep((StageSpan(psi, 0, 1, 2 * n - 1, early),), (1.0,) * (2 * n), (1.0, 0.0) * n,
                    (False, True) * n)


def last_microbatch(psi: float, accumulated: bool, early: float = 0.0) -> RankStep:
    """The last F and B of ``accumulation_loop``, which hold its peaks: after earlier
    microbatches (``accumulated``) its gradients exist from its start (weight gradients came
    first at index -1)."""
    return RankStep((StageSpan(psi, 0, -1 if accumulated else 1, 1, early),), (1.0, 1.0),
                    (1.0, 0.0), (False, True))


@dataclass(frozen=True)
class StateRules:
    """How a rank keeps its model state through a step (``rank_state_instants``).

    ``shard``: ZeRO's shard degree of the dense parameters' group less ep (dp_shard x cp); the
    dense ones shard over ``shard x ep``, routed experts over ``shard``. ``grad_bytes``: a
    gradient element as held (the reduction dtype; FSDP2 accumulates in it). ``master``: bf16
    parameters with fp32 masters in the optimizer (ZeRO-0/1/2). ``accumulates``: ZeRO-2/3 hold
    full-size gradients while microbatches accumulate (sync off). ``held``: ZeRO-3 units stay
    gathered from their first forward to their flush. ``block``: one rank's largest block's
    parameters; ``largest``: its largest parameter's bytes (a bucket closes at most that far
    past its size). ``offloaded``: the optimizer state lives on the host. ``resting_grads``:
    the gradients outlive the step (ZeRO-1's accumulation buffer, ZeRO-2's reduced slice);
    otherwise ``zero_grad`` frees them and a stage has none before its first backward (but its
    ``early`` ones at that backward's start, while its activations are all live)."""

    shard: int
    ep: int
    stage: int
    compute_bytes: int
    grad_bytes: int
    master: bool
    accumulates: bool
    held: bool
    pipelined: bool
    block: float
    largest: float
    bucket_bytes: float | None = None
    offloaded: bool = False
    resting_grads: bool = True
    fused_step: bool = False  # AdamW's fused kernel: no temporaries (``adamw_step_fused``)
    explain: bool = True  # write each instant's notes (the planner, pricing thousands, does not)


@dataclass(frozen=True)
class StateInstant:
    """One instant of a rank's step that can be its peak: the model state's bytes by component,
    and which activations are live: ``level`` rank-microbatches of them, less the head's and
    the top block's when ``less_head_and_top`` (a backward has freed them by then)."""

    parameters: float
    gradients: float
    optimizer: float
    transient: float
    level: float
    less_head_and_top: bool = False
    notes: tuple[str, ...] = ()
    loss: bool = False  # in the loss's backward: add ``loss_backward_bytes`` to the activations


def rank_state_instants(psi: float, experts: float, step: RankStep, rules: StateRules
                        ) -> Iterator[StateInstant]:
    """Every instant of a rank's ``step`` that can be its peak, with ``psi`` parameters of which
    ``experts`` are routed experts (a stage's in the rank's proportion): during and right after
    each action, ZeRO-3's reduction in a backward, ZeRO-2's reduction (during the last backward;
    in a pipeline, a stage's flush), then the optimizer step. The derivations and measurements
    are ``loom.train.memory``'s docstring's; the launch-time estimator weighs these over the
    runtime's real schedule, the planner over ``last_microbatch`` with its family's peak."""
    r = rules
    share = experts / psi if psi else 0.0
    master = r.master and r.stage < 3

    def state(p: float, accumulating: bool = False, with_master: bool = master
              ) -> tuple[float, float, float]:
        kw = dict(accumulating=accumulating, grad_bytes=r.grad_bytes, master=with_master)
        dense = model_state_bytes(p * (1 - share), r.shard * r.ep, r.stage, **kw)
        expert = model_state_bytes(p * share, r.shard, r.stage, **kw)
        return dense[0] + expert[0], dense[1] + expert[1], dense[2] + expert[2]

    params, grads, optim = state(psi)
    if r.offloaded:
        optim = 0.0
    stage, block = r.stage, r.block
    # ZeRO-3: the gathered block in use + the prefetched one (none extra when units are held)
    gathering = 2 * r.compute_bytes * block if stage == 3 and not r.held else 0.0
    # FSDP2 reduce-scatters each unit in the backward (every microbatch's when none accumulate;
    # else only the last one's, which the accumulated instant covers); a pipeline stage is
    # flushed by the runtime instead (indices are F, B, F, B... without one)
    in_backward = stage == 3 and not r.held and not r.pipelined and block > 0
    last_index = len(step.during) - 1
    # ZeRO-3 units whole from their first F to their flush: every stage when held, the
    # vocabulary rows always (``StageSpan.gathered``)
    whole = [st for st in step.stages if r.held or stage == 3 and st.gathered]
    # what accumulating turns each stage's gradients into: full-size beside the slice (the
    # gathered rows' always: GatheredRows reduces once a step)
    grown = {st: state(st.psi, True)[1] - state(st.psi)[1] for st in step.stages
             if r.accumulates or stage == 3 and st.gathered}
    # a stage's gradients at rest, and those that exist from its first backward's start
    at_rest = {st: state(st.psi)[1] for st in step.stages}
    early = {st: state(st.early)[1] for st in step.stages}
    for index in range(len(step.during)):
        for level, ended in ((step.during[index], False), (step.after[index], True)):
            # a stage's parameters are whole from its first F to its flush; its full-size
            # gradients from its first weight-gradient piece to the flush
            gathered = sum(r.compute_bytes * st.psi for st in whole if
                           st.first_f <= index and (index < st.last or not ended and
                                                    index == st.last))
            full = [st for st in grown if (st.first_w < index <= st.last if not ended
                                           else st.first_w <= index < st.last)]
            g = grads + sum(grown[st] for st in full) if full else grads
            if not r.resting_grads:  # none before a stage's first backward, its early ones
                # at that backward's start
                g -= sum(at_rest[st] for st in step.stages if index < st.first_w) + sum(
                    at_rest[st] - early[st] for st in step.stages
                    if index == st.first_w and not ended)
            # FSDP2 computes a unit's fresh gradient beside its accumulated one, then adds it
            # (a block's; the vocabulary rows' fresh gradient is the caller's, with its T)
            fresh = r.grad_bytes * block if stage == 3 and any(
                not st.gathered for st in full) else 0.0
            notes = []
            if gathered and r.explain:
                notes.append(f"ZeRO-3 units held gathered (reshard_after_forward = false,"
                             f" or the vocabulary rows): {gathered:,.0f} B of whole parameters"
                             f" in 'parameters'")
            if full and r.explain:
                notes.append(f"gradients full-size while microbatches accumulate (ZeRO-"
                             f"{stage}, reduce-scattered after the last backward):"
                             f" {sum(r.grad_bytes * st.psi for st in full):,.0f} B in"
                             f" 'gradients'")
            yield StateInstant(params + gathered, g, optim, gathering + fresh, level,
                               notes=tuple(notes))
            if not ended and index < len(step.loss) and step.loss[index]:
                # the loss's backward, before the output layer's: the head's fresh weight
                # gradient not made yet (freed by zero_grad, a first backward has none of it)
                before = g - sum(early[st] for st in step.stages
                                 if index == st.first_w and not r.resting_grads)
                yield StateInstant(params + gathered, before, optim, gathering, level,
                                   notes=(*notes, "the loss's backward: its fp32 gradients"
                                          " beside the saved log-probabilities in"
                                          " 'activations'") if r.explain else (), loss=True)
            if (in_backward and not ended and index % 2 and not full
                    and (not r.accumulates or index == last_index)):
                # ZeRO-3 reducing in this backward: at the end of the top block's backward its
                # unsharded gradients and FSDP2's reduce-scatter input (a block each) beside the
                # gathered blocks; the head's and that block's activations are freed by then
                yield StateInstant(params, g, optim, gathering + 2 * r.grad_bytes * block,
                                   level, True, ("ZeRO-3 backward: a block's unsharded gradients"
                                                 " and the reduce-scatter input in"
                                                 " 'transient'",))
            # ZeRO-2's reduction: without a pipeline during the last backward (its hooks pack
            # the gradients as they come, the full-size ones already in ``g`` if accumulated);
            # in one, priced as the flush after a stage's last backward piece, all of them
            # full-size (a W's case; a last B reduces in its hooks as without a pipeline, so
            # this is an upper bound there)
            reducing = [st for st in step.stages if st.last == index]
            if stage == 2 and reducing and ended == r.pipelined:
                flushed = sum(st.psi for st in reducing)
                accumulated = r.pipelined or bool(full)
                full_size, packing = zero2_reduction_bytes(
                    flushed, r.shard, accumulated=accumulated, bucket_bytes=r.bucket_bytes,
                    largest=r.largest)
                packing += state(flushed)[1] - 4 * flushed / r.shard  # the slices, by group
                note = (*notes, f"ZeRO-2 reduction: gradients packed into buckets of"
                                f" {r.bucket_bytes or BUCKET_BYTES:,.0f} B (at most three held,"
                                f" one beside full-size gradients) and the slices' outputs in"
                                f" 'transient'") if r.explain else ()
                if r.pipelined:
                    yield StateInstant(params + gathered, g + full_size, optim, packing,
                                       level, notes=note)
                else:  # the first buffer beside every activation; three once the head and
                    # the top block are done (two buckets' gradients cannot come sooner)
                    first = zero2_bucket_bytes(flushed, r.bucket_bytes, r.largest)
                    yield StateInstant(params, g, optim, first, level, notes=note)
                    if not accumulated:
                        yield StateInstant(params, g, optim, packing, level, True, note)
    # Unfused, AdamW's two temporaries, the size of the fp32 state it steps (the moments', not
    # the masters held beside them under bf16); none on the device when the state is on the
    # host, none from the fused kernel (elementwise, in place)
    if r.offloaded or r.fused_step:
        yield StateInstant(params, grads, optim, 0.0, 0.0, notes=(
            "optimizer step: " + ("state on the host" if r.offloaded
                                  else "fused AdamW, no temporaries"),))
    else:
        yield StateInstant(params, grads, optim, state(psi, False, False)[2], 0.0,
                           notes=("optimizer step: AdamW's two temporaries in 'transient'",))
