"""Per-rank memory of a layout, for the planner's cost model (``CostModel.memory``).

The bytes are ``loom.formulas.memory``'s, the formulas and model-state instants the launch-time
estimator uses too: ZeRO model state (Loom's: full-size gradients while microbatches accumulate,
ZeRO-3 stages held gathered inside pipelines, ZeRO's reductions and the optimizer step),
per-block activations by tp / SP / cp / recomputation, the head's, and the schedule's peak
microbatches in flight (``PEAK_IN_FLIGHT``; under vocabulary parallelism across the pipeline
the runtime's schedule with its S and T passes, ``vocab_schedule_levels``, and the estimator's
rows, exp-logits and embedding buffers), and all-gather context parallelism's gathered keys and
values while a layer's attention runs (``allgather_attention_bytes``). It communicates
nothing. Split from ``cost_model.py`` to keep that module about time.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from loom.layout import Layout
from loom.schedule.ir import Op
from loom.schedule.select import schedule_of
from loom.schedule.validate import peak_memory
from loom.schedule.vocab_passes import vocab_schedule
from loom.formulas.memory import (StateRules, adamw_step_fused, allgather_attention_bytes,
                                  block_activation_bytes,
                                  last_microbatch, framework_state_bytes, head_activation_bytes,
                                  bucket_allreduce_bytes, gathered_logits_bytes,
                                  korthikanti_block_activation_bytes, largest_parameter,
                                  unfused_scores_bytes,
                                  loss_backward_bytes, op_sac_block_bytes, rank_state_instants,
                                  recomputed_fraction,
                                  vocab_embedding_bytes, vocab_pass_bytes)


# Peak microbatches in flight on the worst rank, in units of one rank's microbatch (a chunk of v
# weighs 1/v), for m >= p (dualpipev: m >= 2p); the validator's accounting. Checked against
# ``loom.schedule.validate.peak_memory`` in tests/unit/plan/test_cost_model.py.
PEAK_IN_FLIGHT = {
    "gpipe": lambda p, m, v: m,
    "looped_bfs": lambda p, m, v: m,
    "1f1b": lambda p, m, v: p,
    "zb_h1": lambda p, m, v: p,
    "zbv": lambda p, m, v: p,
    # one wave: p; more (v = 2W sweeps): measured at m >= 4p, pinned in
    # tests/unit/schedule/test_hanayo_waves.py (waiting turns hold a few chunks longer)
    "hanayo": lambda p, m, v: p if v <= 2 else p + ((p + 1) // 3) / v,
    # m a multiple of p (Megatron's rule; the planner's space keeps to it): at m = p every
    # microbatch is in flight at once
    "interleaved_1f1b": lambda p, m, v: p if m == p else p + (p - 1) / v,
    "zb_h2": lambda p, m, v: min(2 * p - 1, m),
    "v_half": lambda p, m, v: p // 2 + 1,
    "v_min": lambda p, m, v: (p - 1) // 3 + 2,
    "dualpipev": lambda p, m, v: p + 0.5,
}


def layout_memory(model: Any, lay: Layout, in_flight: tuple[float, ...] | None = None, *,
                  total_only: bool = False, rank: int | None = None) -> Any:
    """Bytes by component at the worst instant of the worst pipeline rank of ``model`` (a
    ``CostModel``; checked first: most layouts of a large model do not fit, and this is a
    fraction of ``evaluate``'s work). ``in_flight``: the peak activation units of each rank
    of a known schedule (a searched one, once found), instead of the family's. ``total_only``:
    just the sum (the planner's screening drops most layouts on it). ``rank``: that end
    rank's worst instant instead (0 or pp - 1)."""
    v_shaped = lay.v_shaped
    counts, _, owned = model.ranks.geometry(lay.pp, lay.chunks, v_shaped)
    states = _states(model, lay, v_shaped)
    dense_act, moe_act, head, full_block = _activation_bytes(model, lay)
    split_vocab = lay.vocab_parallel_pp and lay.pp > 1
    windows: tuple[int, ...] = ()
    if split_vocab:  # the last stage ends at its final norm; the rows' passes on every rank
        m = model.model
        tokens = lay.micro_batch * model.seq // lay.cp
        head = head_activation_bytes(s=model.seq // lay.cp, b=lay.micro_batch, h=m.dim,
                                     vocab=0, e=model.e)
        if in_flight is None and lay.schedule != "search":
            in_flight, windows = vocab_schedule_levels(lay, m.n_layers)
        else:  # at most the rank's own microbatches in flight hold S's output
            windows = tuple(int(max(in_flight or (lay.pp,))) for _ in range(lay.pp))
        # between S and T: the shard's fp32 exp-logits and the received X (parameter dtype on
        # the wire, as the planner prices); all step long: the partial embeddings and the
        # first stage's inputs or their gradients (``loom.train.memory``'s accounting)
        one_pass = vocab_pass_bytes(tokens=tokens, vocab=m.vocab_size, shards=lay.pp * lay.tp,
                                    h=m.dim, wire=model.e)
        held_all_step = vocab_embedding_bytes(microbatches=lay.microbatches, tokens=tokens,
                                              h=m.dim, e=model.e, wire=model.e)
    if lay.schedule == "search":  # the search keeps every rank within its limit (0: pp)
        peak = lay.schedule_memory_limit or float(lay.pp)
    else:
        peak = PEAK_IN_FLIGHT.get(lay.schedule, lambda p, mm, v: 1)(lay.pp, lay.microbatches,
                                                                   lay.chunks)
    last = len(counts) - 1
    level_everywhere = v_shaped or lay.schedule == "search"
    attention = attention_transient(model, lay)  # at the instants with every activation
    worst: tuple[dict[str, float], float, float] | None = None
    worst_total = 0.0
    per_mbs = _per_microbatch(model, lay.pp, lay.chunks, v_shaped, dense_act, moe_act)
    for r, instants in states.items():
        if rank is not None and r != rank:
            continue
        own = owned[r]
        per_mb = per_mbs[r]
        # in flight on rank r: the schedule's peak on rank 0 (and on every rank of a V, whose
        # ranks are balanced), one fewer per rank further down a looped pipeline
        # (the search's limit binds every rank alike)
        units = peak if (r == 0 or level_everywhere) else max(1.0, peak - r)
        acts = per_mb * (units if in_flight is None else in_flight[r])
        acts += full_block  # one block's full set while it is recomputed (full recompute)
        holds_head = last in own
        if holds_head:  # the head's logits live from its F to its backward: briefly
            acts += head
        if split_vocab:
            acts += windows[r] * one_pass + held_all_step
        # the passes' instant, and ZeRO-2's reduction during the last backward, hold them
        freed = (head if holds_head else 0.0) + dense_act  # the head's and the top block's
        loss = loss_backward_bytes(  # the loss's backward, as the estimator prices it
            tokens=lay.micro_batch * model.seq // lay.cp, vocab=model.model.vocab_size // lay.tp,
            fused=lay.tp > 1 and lay.vocab_parallel) if holds_head and not split_vocab else 0.0
        for entry in instants:
            kind = entry["_acts"]
            held = acts if kind == "all" else 0.0 if kind == "none" else acts + loss \
                if kind == "loss" else max(0.0, acts - freed)
            extra = attention if kind == "all" else 0.0
            total = entry["_total"] + held + extra
            if worst is None or total > worst_total:
                worst, worst_total = (entry, held, extra), total
    assert worst is not None
    if total_only:
        return worst_total
    entry, acts, extra = worst
    return {name: (acts if name == "activations" else value + extra if name == "transient"
                   else value) for name, value in entry.items() if not name.startswith("_")}


def _per_microbatch(model: Any, pp: int, chunks: int, v_shaped: bool, dense: float,
                    moe: float) -> dict[int, float]:
    """The end ranks' activations of one microbatch, their stages' blocks at ``dense`` and
    ``moe`` bytes each, cached on ``model`` (a few shapes recur across the layouts)."""
    key = (pp, chunks, v_shaped, dense, moe)
    found = model._per_mb_cache.get(key)
    if found is None:
        counts, _, owned = model.ranks.geometry(pp, chunks, v_shaped)
        found = model._per_mb_cache[key] = {
            r: sum(counts[s][0] * dense + counts[s][1] * moe for s in owned[r])
            for r in {0, pp - 1}}
    return found


def attention_transient(model: Any, lay: Layout) -> float:
    """What one layer's attention holds while it runs, as the estimator prices it
    (``loom.train.memory.attention_transient_bytes``): all-gather context parallelism's
    gathered keys and values under Loom's profile, else 0 (the other stacks' all-gather
    buffers are not modelled)."""
    if lay.cp == 1 or lay.cp_mode != "allgather" or not model.framework.is_loom:
        return 0.0
    m = model.model
    return allgather_attention_bytes(s=model.seq // lay.cp, b=lay.micro_batch,
                                     kv_heads=m.n_kv_heads / lay.tp, head_dim=m.head_dim,
                                     cp=lay.cp, e=model.e)


@functools.lru_cache(maxsize=64)
def vocab_schedule_levels(lay: Layout, n_layers: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Under vocabulary parallelism across the pipeline, per rank: the peak activation units
    of the schedule the runtime runs (``vocab_schedule``: 1F1B holds one more warm-up
    forward) and the most microbatches whose S has run and T not (their exp-logits held)."""
    schedule = vocab_schedule(schedule_of(lay, max_stages=n_layers))
    windows = []
    for row in schedule.actions:
        live = most = 0
        for action in row:
            live += action.op is Op.S
            most = max(most, live)
            live -= action.op is Op.T
        windows.append(most)
    return peak_memory(schedule), tuple(windows)


def _states(model: Any, lay: Layout, v_shaped: bool) -> dict[int, list[dict[str, float]]]:
    """The end ranks' instants (``_instants``), cached: the model state at each instant depends
    on far fewer knobs than the activations (the planner screens hundreds of thousands of
    layouts with this)."""
    key = _state_key(lay, v_shaped)
    states = model._memory_cache.get(key)
    if states is None:
        rank_params = model.ranks.end_rank_params(lay)
        experts = model.ranks.end_rank_expert_params(lay)
        counts, _, owned = model.ranks.geometry(lay.pp, lay.chunks, v_shaped)
        head = model.model.vocab_size * model.model.dim / lay.tp  # the output layer's weight
        if lay.vocab_parallel_pp and lay.pp > 1:
            head = 0.0  # the rows' gradients come with T, not first in a stage's backward
        states = {r: _instants(model, lay, rank_params[r], experts[r],
                               head if len(counts) - 1 in owned[r] else 0.0)
                  for r in rank_params}
        model._memory_cache[key] = states
    return states


def _state_key(lay: Layout, v_shaped: bool) -> tuple:
    """What the model state's instants depend on."""
    return (lay.pp, lay.chunks, v_shaped, lay.tp, lay.ep, lay.dp_shard, lay.cp, lay.zero_stage,
            lay.microbatches > 1, lay.vocab_parallel_pp)


def memory_floor(model: Any, lay: Layout) -> float:
    """A lower bound of ``layout_memory``'s total that ignores the activations: the largest
    instant of model state, gradients, optimizer and transients on the end ranks. Whatever the
    microbatch, schedule and recomputation, ``lay`` does not fit below it."""
    key = _state_key(lay, lay.v_shaped)
    floor = model._memory_floor_cache.get(key)
    if floor is None:
        states = _states(model, lay, lay.v_shaped)
        floor = max(entry["_total"] for instants in states.values() for entry in instants)
        model._memory_floor_cache[key] = floor
    return floor


def _activation_bytes(model: Any, lay: Layout) -> tuple[float, float, float, float]:
    """(a dense block's, an MoE block's, the head's activations for one microbatch, and one
    block's full set held while it is recomputed under full or every-k recomputation, else
    0), cached
    per shape on ``model``: the planner asks for the same few shapes hundreds of thousands of
    times."""
    key = (lay.cp, lay.micro_batch, lay.tp, lay.sequence_parallel, lay.recompute,
           lay.recompute_every)
    cache = model._activation_cache
    if key in cache:
        return cache[key]
    m = model.model
    s_local, b = model.seq // lay.cp, lay.micro_batch
    sp = lay.sequence_parallel and lay.tp > 1
    width = m.expert_ffn_dim or m.ffn_dim
    # an MoE block as a dense one of its active experts' width (routed and shared, of the dense
    # MLP's kind), plus the experts' input gathered once per assignment: k - 1 D-wide rows per
    # token beyond the block's own, in units of that kind's F-wide saved tensors (4 or 2)
    gated = m.mlp == "swiglu"
    moe_f = width * (m.top_k + m.n_shared_experts) + (m.top_k - 1) * m.dim / (4 if gated else 2)

    fw = model.framework
    # a written-out core's saved mask and probabilities in an eager block (Scaling's)
    scores = unfused_scores_bytes(e=model.e, softmax_in_fp32=fw.softmax_in_fp32,
                                  dropout=fw.dropout) \
        if fw.attention_kernel == "unfused" and fw.eager_copies else None

    def block(f: float, recompute: str, gated: bool) -> float:
        """One block's bytes; ``gated``: a SwiGLU MLP (dense or experts), else GELU."""
        if recompute == "selective" and fw.selective == "ops":  # torchtitan's op-level policy
            return op_sac_block_bytes(s=s_local, b=b, h=m.dim, f=f, a=m.n_heads,
                                      kv=m.n_kv_heads, t=lay.tp, sequence_parallel=sp,
                                      e=model.e, gated=gated)
        if not fw.is_loom and (fw.sp_shards_all or not fw.flash_attention or fw.dropout):
            return korthikanti_block_activation_bytes(
                s=s_local, b=b, h=m.dim, f=f, a=m.n_heads, kv=m.n_kv_heads, t=lay.tp,
                sequence_parallel=sp, sp_shards_all=fw.sp_shards_all, e=model.e,
                recompute=recompute, flash=fw.flash_attention, dropout=fw.dropout, gated=gated,
                scores_bytes=scores, norm_outputs=fw.norm_saves_output and not fw.fused_norm,
                eager_copies=fw.eager_copies)
        if fw.sp_keeps_gathered:  # Loom's block with the gathered inputs saved whole
            if recompute == "full":
                # the checkpoint keeps the block's input: the residual stream, which DTensor's
                # sequence parallelism (torchtitan's plan) leaves sharded over tp between blocks
                return s_local * b * m.dim * model.e / (lay.tp if sp else 1)
            return block_activation_bytes(s=s_local, b=b, h=m.dim, f=f, a=m.n_heads,
                                          kv=m.n_kv_heads, t=lay.tp, sequence_parallel=sp,
                                          e=model.e, recompute=recompute, compiled=True,
                                          gated=gated)
        return block_activation_bytes(s=s_local, b=b, h=m.dim, f=f, a=m.n_heads,
                                      kv=m.n_kv_heads, t=lay.tp, sequence_parallel=sp,
                                      e=model.e, recompute=recompute, gated=gated)

    if fw.gathered_logits:  # the whole vocabulary on every tp rank, and the loss's backward
        head = head_activation_bytes(s=s_local, b=b, h=m.dim, vocab=m.vocab_size, e=model.e) \
            + gathered_logits_bytes(tokens=s_local * b, vocab=m.vocab_size, e=model.e)
    else:
        head = head_activation_bytes(s=s_local, b=b, h=m.dim, vocab=m.vocab_size // lay.tp,
                                     e=model.e)
    # every k-th block recomputed (``every_k``): a block's bytes as the model's average over
    # its recomputed and kept blocks
    share = recomputed_fraction(lay.recompute, lay.recompute_every, m.n_layers)

    def averaged(f: float) -> float:
        if lay.recompute != "every_k":
            return block(f, lay.recompute, gated)
        return share * block(f, "full", gated) + (1 - share) * block(f, "none", gated)

    full = block(m.ffn_dim, "none", gated) if share else 0.0
    cache[key] = (averaged(m.ffn_dim), averaged(moe_f), head, full)
    return cache[key]


def search_units_left(model: Any, lay: Layout, budget: float, cap: float) -> float:
    """The most activation units (whole ones, at most ``cap``) a searched schedule of ``lay``
    may hold with its rank's peak within ``budget`` bytes; 0 when not even one fits. The peak
    grows with the units (``layout_memory`` is a maximum of instants, each affine in them), so
    a bisection over whole units finds it."""
    def fits(units: float) -> bool:
        return layout_memory(model, replace(lay, schedule_memory_limit=units), total_only=True) <= budget

    low, high = 1, int(cap)
    if high < 1 or not fits(1):
        return 0.0
    while low < high:  # the largest fitting count in [1, cap]
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return float(low)


def _instants(model: Any, lay: Layout, psi: float, experts: float = 0.0, head: float = 0.0
              ) -> list[dict[str, float]]:
    """``_rank_instants``, cached on ``model`` by the values it reads: layouts whose state keys
    differ (in the chunks, the schedule, the pipeline's length) often put the same parameters on
    an end rank under the same rules (a fifth as many distinct ones in the 1T plan). The
    entries are shared, never modified."""
    key = (psi, experts, head, model.zero_stage_of(lay), lay.dp_shard * lay.cp,
           lay.ep, lay.tp, lay.pp > 1, lay.sequence_parallel, lay.vocab_parallel,
           lay.vocab_parallel_pp, lay.microbatches > 1, lay.dp > 1)
    cache = model._instants_cache
    found = cache.get(key)
    if found is None:
        found = cache[key] = _rank_instants(model, lay, psi, experts, head)
    return found


def _rank_instants(model: Any, lay: Layout, psi: float, experts: float = 0.0, head: float = 0.0
                   ) -> list[dict[str, float]]:
    """The instants of a rank's step that can be its peak, as the estimator weighs them
    (``loom.formulas.memory.rank_state_instants``) over its last microbatch: the passes (peak
    activations beside the gradients accumulated so far), ZeRO's reductions (in the last
    backward, or a pipeline stage's flush) and the optimizer step, the largest of each kind; ``_acts`` tells the caller which activations each holds (all, none,
    or all but the head's and the top block's). Under a pipeline the first is an upper bound:
    the activation peak of the warm-up is counted with the accumulated gradients of the steady
    state. ``experts`` of the ``psi`` parameters are routed experts: ZeRO shards them over
    dp_shard x cp, the dense ones over dp_shard x ep x cp; ``head`` of them are the output
    layer's, whose gradients a backward makes first."""
    if not model.framework.is_loom:
        return _framework_instants(model, lay, psi, experts)
    stage = model.zero_stage_of(lay)
    rules = StateRules(
        shard=lay.dp_shard * lay.cp, ep=lay.ep, stage=stage, compute_bytes=model.e,
        grad_bytes=model.grad_bytes, master=model.e == 2, accumulates=stage in (2, 3),
        # ZeRO-3 stages held gathered across the step inside a pipeline (to_overrides)
        held=stage == 3 and lay.pp > 1, pipelined=lay.pp > 1,
        block=max(model.ranks.layer_params(True, lay), model.ranks.layer_params(False, lay)),
        largest=4 * largest_parameter(model.model, lay.tp, lay.ep),
        resting_grads=stage in (1, 2), explain=False,
        # the trainer's fused AdamW on the accelerator (no temporaries) where the layout allows;
        # the rank is priced as if it held the ends (the embedding's and head's tensors)
        fused_step=adamw_step_fused("auto", tp=lay.tp, zero_stage=stage,
                                    sequence_parallel=lay.sequence_parallel,
                                    vocab_parallel=lay.vocab_parallel, moe=experts > 0,
                                    vocab_parallel_pp=lay.vocab_parallel_pp))
    # FSDP2's float8 all-gather: the two gathered blocks every pass instant holds (not the
    # gradients' reduce-scatter beside them) have their FP8 linears at 1 byte
    float8 = 2 * (rules.block - gathered_block(model, lay)) * model.e \
        if stage == 3 and not rules.held else 0.0
    worst: dict[str, dict[str, float]] = {}
    for instant in rank_state_instants(psi, experts,
                                       last_microbatch(psi, lay.microbatches > 1, head), rules):
        kind = "none" if not instant.level else (
            "less_head_and_top" if instant.less_head_and_top else "loss" if instant.loss
            else "all")
        entry = {"parameters": instant.parameters, "gradients": instant.gradients,
                 "optimizer": instant.optimizer, "activations": 0.0,
                 "transient": instant.transient - (float8 if instant.level else 0.0),
                 "_acts": kind}
        entry["_total"] = (instant.parameters + instant.gradients + instant.optimizer
                           + entry["transient"])
        if kind not in worst or entry["_total"] > worst[kind]["_total"]:
            worst[kind] = entry  # the activations of a kind are alike: its largest state wins
    return list(worst.values())


def gathered_block(model: Any, lay: Layout) -> float:
    """A ZeRO-3 unit's gathered bytes in elements of ``model.e`` (the largest layer's
    parameters on a rank): FSDP2's float8 all-gather (``CostModel.fp8_all_gather``) holds the
    FP8 linears' weights at 1 byte."""
    e, ranks = model.e, model.ranks
    return max(ranks.layer_params(moe, lay) - ranks.fp8_layer_params(moe, lay) * (e - 1) / e
               for moe in (True, False))


def _framework_instants(model: Any, lay: Layout, psi: float, experts: float
                        ) -> list[dict[str, float]]:
    """``_instants`` for another stack's profile (``model.framework``, not Loom's): its bytes
    per parameter (``framework_state_bytes``), the last microbatch's passes with every
    activation (ZeRO-3: two gathered blocks in flight, or the stages held gathered inside a
    pipeline), and the optimizer step (with foreach AdamW's two temporaries where the profile
    has them). Loom's own buckets and reduction instants are Loom's trainer's and are not
    assumed of the others, nor are its full-size gradients while microbatches accumulate under
    ZeRO-2/3 without a pipeline: FSDP2, DeepSpeed's ZeRO-2/3 and Megatron's FSDP reduce-scatter
    each microbatch's gradients into the rank's shard, so a rank holds only its shard between
    microbatches (the profile's ``grad_bytes`` per parameter over dp_shard x cp; until 29 Nov
    2026 ZeRO-3 was priced with every parameter's gradient here, which judged a published 8B
    run on 8 H100s out of memory with 30 GiB of fp32 gradients it never held). Inside a
    pipeline the stage's gradients are held whole (see below)."""
    fw = model.framework
    stage = model.zero_stage_of(lay)  # the cp ranks alone shard another stack's state
    d = lay.dp_shard * lay.cp

    def state(optimizer_bytes: int = fw.optimizer_bytes) -> tuple[float, ...]:
        kw = dict(param_bytes=fw.param_bytes, grad_bytes=fw.grad_bytes,
                  optimizer_bytes=optimizer_bytes)
        dense = framework_state_bytes(psi - experts, d * lay.ep, stage, **kw)
        expert = framework_state_bytes(experts, d, stage, **kw)
        return tuple(a + b for a, b in zip(dense, expert))

    params, grads, optim = state()
    block = gathered_block(model, lay)
    held = stage == 3 and lay.pp > 1
    transient = 2 * model.e * block if stage == 3 and not held else 0.0
    # ZeRO-3 inside a pipeline: torch's pipelining runs FSDP without gradient sync until a
    # stage's last microbatch (``backward_maybe_with_nosync``), so the stage's gradients are
    # held whole while microbatches accumulate (assumed of the other stacks too)
    passes_grads = fw.grad_bytes * psi if held and lay.microbatches > 1 else grads
    temporaries = state(8)[2] if fw.optimizer_temporaries else 0.0  # two fp32 state slices
    step_grads, step_copy = grads, 0.0
    if fw.fp32_grad_slice and stage <= 1:  # the step keeps its own slice (all without ZeRO)
        own = d * lay.ep if stage else 1  # and copies it to fp32, freeing the 16-bit one
        step_grads, step_copy = (grads / own if stage else 0.0), 4 * psi / own
    out = [{"parameters": params + (model.e * psi if held else 0.0), "gradients": passes_grads,
            "optimizer": optim, "activations": 0.0, "transient": transient, "_acts": "all"},
           {"parameters": params, "gradients": step_grads, "optimizer": optim,
            "activations": 0.0, "transient": temporaries + step_copy, "_acts": "none"}]
    if fw.bucket_allreduce and lay.dp > 1:  # after the backward: one fp32 bucket in flight
        out.append({"parameters": params, "gradients": grads, "optimizer": optim,
                    "activations": 0.0, "_acts": "none",
                    "transient": bucket_allreduce_bytes(psi, grad_bytes=fw.grad_bytes)})
    for entry in out:
        entry["_total"] = sum(v for k, v in entry.items() if not k.startswith("_"))
    return out
