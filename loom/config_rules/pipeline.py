"""The pipeline's rules: schedule families and their sizes, the search's knobs, tied embeddings
and routes across stages, ZeRO inside stages, SkipPipe's paths and CheckFree's recovery.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from loom.config_rules.common import nearest_multiples
from loom.config_rules.data import varlen_budgets
from loom.errors import ConfigError, suggest
from loom.schedule.families import SEARCH_PLACEMENTS, simulation_only, trainable
from loom.schedule.offload import insert_offload
from loom.schedule.paths import SKIPPIPE, skip_count
from loom.schedule.search_places import MAX_CHUNKS
from loom.schedule.ir import MAX_STEP_CELLS
from loom.schedule.select import SEARCH, ChunksError, parse_search_costs, schedule_for

# ``loom.pipeline.partition`` splits the layers by an exact dynamic program of about
# stages x (layers - stages + 1)^2 steps a pass (two passes), ~3 x 10^6 a second in Python: past
# this the split alone takes minutes. Real models are far below it (128 layers on 2 stages:
# 3 x 10^4; 1,000 on 2: 2 x 10^6).
MAX_PARTITION_STEPS = 2 * 10**7

if TYPE_CHECKING:  # the rules read a config; loom.config imports them to run them in resolve()
    from loom.config import Config


# parallel.schedule's default; with pp = 1 any other family is refused
DEFAULT_SCHEDULE = "1f1b"


CHECKFREE_SCHEDULES = ("1f1b", "gpipe")  # one stage per rank, every microbatch through all


def validate_fault(config: Config) -> None:
    """``[fault]``: CheckFree rebuilds a lost middle pipeline stage from the stages on both sides
    (loom/train/checkfree.py), so it needs pp >= 3 and, as built, one rank per stage: no dp, tp,
    cp or ep (a stage's replicas or shards would be a second recovery source, not built), and a
    schedule with one stage per rank (1f1b, gpipe: no interleaving, V or zero bubble). The
    equal block count of neighbouring stages is checked by the launcher (``loom.relaunch``),
    which has the partition. CheckFree+ (first and last stage too) swaps stages (0, 1) and
    (pp-2, pp-1) on every other microbatch (loom/pipeline/out_of_order.py): pp >= 4, untied
    embeddings, concatenated rows."""
    fault, par, tr = config.fault, config.parallel, config.train
    if fault.recovery == "checkpoint":
        for name in ("test_kill_stage", "test_kill_stages", "test_kill_steps"):
            if getattr(fault, name) not in (-1, ()):
                raise ConfigError(f"fault.{name}", getattr(fault, name),
                                  "injects a failure for fault.recovery=checkfree(_plus) only"
                                  " (under checkpoint recovery kill a worker from outside,"
                                  " --max-restarts)")
        return
    if not (math.isfinite(fault.recovery_lr_scale) and fault.recovery_lr_scale > 0):
        raise ConfigError("fault.recovery_lr_scale", fault.recovery_lr_scale,
                          "must be a finite number > 0 (1: the schedule's learning rate)")
    plus = fault.recovery == "checkfree_plus"
    if plus and par.pp < 4:
        raise ConfigError("fault.recovery", fault.recovery,
                          f"needs parallel.pp >= 4: out-of-order microbatches swap stages (0, 1)"
                          f" and (pp-2, pp-1), two pairs that must not share a stage"
                          f" (pp = {par.pp})")
    if plus and config.model.tie_embeddings:
        raise ConfigError("model.tie_embeddings", True, "checkfree_plus keeps the embedding and"
                          " the head apart (each copied to its neighbour); untie them")
    if plus and config.data.packing != "concat":
        raise ConfigError("data.packing", config.data.packing,
                          "checkfree_plus runs concatenated rows only (data.packing = concat)")
    if par.pp < 3:
        raise ConfigError("fault.recovery", fault.recovery,
                          f"needs parallel.pp >= 3 (a lost stage is rebuilt from the stages on"
                          f" both sides; pp = {par.pp})")
    others = {"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "ep": par.ep,
              "cp": par.cp, "tp": par.tp}
    for name, degree in others.items():
        if degree != 1:
            raise ConfigError(f"parallel.{name}", degree,
                              f"fault.recovery={fault.recovery} runs with one rank per pipeline"
                              " stage only (dp, tp, cp and ep = 1): recovery inside replicated"
                              " or sharded stages is not built")
    if par.schedule not in CHECKFREE_SCHEDULES:
        raise ConfigError("parallel.schedule", par.schedule,
                          f"fault.recovery={fault.recovery} needs one stage per rank with every"
                          f" microbatch through every stage: one of {', '.join(CHECKFREE_SCHEDULES)}")
    if fault.test_kill_stage >= 0 and fault.test_kill_stages:
        raise ConfigError("fault.test_kill_stages", ",".join(map(str, fault.test_kill_stages)),
                          "replaces fault.test_kill_stage and test_kill_count; set one of them")
    kills = fault.test_kill_stages or ((fault.test_kill_stage,) if fault.test_kill_stage >= 0
                                       else ())
    if fault.test_kill_steps:
        steps = fault.test_kill_steps
        if fault.test_kill_step:
            raise ConfigError("fault.test_kill_steps", ",".join(map(str, steps)),
                              "replaces fault.test_kill_step; set one of them")
        if len(steps) != len(fault.test_kill_stages):
            raise ConfigError("fault.test_kill_steps", ",".join(map(str, steps)),
                              "needs one step per entry of fault.test_kill_stages"
                              f" ({len(fault.test_kill_stages)} given)")
        if any(not 1 <= s <= tr.steps for s in steps) or list(steps) != sorted(set(steps)):
            raise ConfigError("fault.test_kill_steps", ",".join(map(str, steps)),
                              f"must be strictly increasing steps in [1, train.steps ="
                              f" {tr.steps}]")
    if not kills:
        return
    name = "fault.test_kill_stages" if fault.test_kill_stages else "fault.test_kill_stage"
    low, high = (0, par.pp - 1) if plus else (1, par.pp - 2)
    for stage in kills:
        if not low <= stage <= high:
            raise ConfigError(name, stage, f"fault.recovery={fault.recovery} recovers stages"
                              f" {low}..{high}" + ("" if plus else "; the first and last stage"
                                                   " need checkfree_plus"))
    if not fault.test_kill_steps and not 1 <= fault.test_kill_step <= tr.steps:
        raise ConfigError("fault.test_kill_step", fault.test_kill_step,
                          f"must be in [1, train.steps = {tr.steps}]")
    if fault.test_kill_count < 1:
        raise ConfigError("fault.test_kill_count", fault.test_kill_count, "must be >= 1")


def _microbatches(config: Config) -> tuple[int, str]:
    """Microbatches per pipeline per step, and how they were counted (for messages)."""
    par, tr = config.parallel, config.train
    if config.data.packing == "varlen":
        step, micro = varlen_budgets(config)
        return step // (par.dp * micro), (
            f"microbatches per pipeline m = global_batch_tokens / (dp * tokens_per_microbatch)"
            f" = {step} / ({par.dp} * {micro}) = {step // (par.dp * micro)}")
    micro = tr.global_batch_size // (par.dp * tr.micro_batch_size)
    return micro, (f"microbatches per pipeline m = global_batch_size / (dp * micro_batch_size)"
                   f" = {tr.global_batch_size} / ({par.dp} * {tr.micro_batch_size}) = {micro}")


def validate_zero_pipeline(config: Config) -> None:
    """ZeRO inside pipeline stages (pp > 1, dp_shard > 1): under ZeRO-3 a schedule that splits
    the backward into I and W keeps its stages gathered across the step (ZeRO-1/2 never
    reshard: their parameters stay whole)."""
    par = config.parallel

    tr = config.train
    micro = tr.global_batch_size // (par.dp * tr.micro_batch_size)
    schedule = schedule_for(par.schedule, par.pp, micro, par.chunks,
                            memory_limit=par.schedule_memory_limit, costs=par.schedule_costs,
                            placement=par.schedule_placement,
                            max_stages=config.model.n_layers)
    splits = any(a.op.name in ("I", "W") for row in schedule.actions for a in row)
    if par.zero_stage == 3 and par.reshard_after_forward and splits:
        raise ConfigError("parallel.reshard_after_forward", True,
                          f"schedule {par.schedule!r} splits the backward into I and W, and a W"
                          " needs the gathered weights its I used: with pp > 1 and dp_shard > 1"
                          " set parallel.reshard_after_forward = false (each stage gathered once"
                          " per step) or use a full-backward schedule (1f1b, gpipe,"
                          " interleaved_1f1b, looped_bfs)")


def _validate_tied_pipeline(config: Config, schedule) -> None:
    """Tied embeddings across pipeline stages (loom.pipeline.runtime.tie_embedding): what has a
    parity test runs (tests/dist/test_pipeline_tied.py: dp, tp, ZeRO-1/2/3, cp and MoE models with
    ep among them); the rest is refused by name."""
    par = config.parallel
    last = schedule.stages_per_route - 1  # of route 0 (each route of bidirectional_v alike)
    if par.dp_shard > 1 and schedule.rank_of(0) == schedule.rank_of(last):
        raise ConfigError("parallel.dp_shard", par.dp_shard,
                          f"schedule {par.schedule!r} puts the first and last stage on one rank,"
                          " where a tied embedding is one Parameter shared by two stages, and"
                          f" ZeRO-{par.zero_stage} cannot shard it in both; use dp_replicate or"
                          " a looped schedule (1f1b, interleaved_1f1b, zb_h1 ...)")


def _validate_routes(config: Config, schedule, how: str) -> None:
    """Schedules with routes (bidirectional_v: two model copies, the runtime sums their
    gradients over mirror ranks): what the runtime trains, and what it refuses until tested."""
    par = config.parallel
    if par.pp % 2:
        raise ConfigError("parallel.pp", par.pp, f"schedule {par.schedule!r} trains with an even"
                          " pp only: with an odd pp the middle rank holds both copies of its"
                          " stages, which the runtime does not sum; use pp = 2, 4, ...")
    if schedule.num_microbatches < 2:
        raise ConfigError("train.global_batch_size", config.train.global_batch_size,
                          f"{how}; schedule {par.schedule!r} sends microbatches alternately"
                          " through its two model copies, so training needs m >= 2 (the"
                          " generator accepts any m >= 1, an even m balances the copies)")
    # ZeRO-1/2 (dp_shard > 1) train: the copy sum acts on the reduced flat slices, which line
    # up on mirror ranks, and the norm leaves the replicas' slices out (loom.pipeline.route_copies)


def _validate_skippipe(config: Config) -> None:
    """schedule = "skippipe" (loom/pipeline/paths_runtime.py): the skip ratio's constraints
    (loom/schedule/paths.py names the one broken), pp x stage_replicas ranks with the replicas
    on dp_replicate, and nothing else inside a replica yet (each rule lifts when it is built)."""
    par, m = config.parallel, config.model
    if par.pp < 2:
        raise ConfigError("parallel.schedule", par.schedule, "needs parallel.pp >= 2")
    skip_count(par.pp, par.skip_ratio)  # ConfigError naming parallel.skip_ratio
    if par.stage_replicas < 1 or par.stage_replicas != par.dp_replicate:
        raise ConfigError("parallel.stage_replicas", par.stage_replicas,
                          f"must equal dp_replicate = {par.dp_replicate} (each rank is one "
                          "replica of one stage: the world is pp x stage_replicas)")
    others = {"parallel.tp": par.tp, "parallel.cp": par.cp, "parallel.ep": par.ep,
              "parallel.dp_shard": par.dp_shard, "parallel.chunks": par.chunks}
    for name, value in others.items():
        if value not in (0, 1):
            raise ConfigError(name, value, "skippipe runs one stage replica per rank, with no"
                              " other parallelism inside it yet; leave it at its default")
    if par.dp_mode != "sync" or par.grad_compression != "none":
        raise ConfigError("parallel.dp_mode", par.dp_mode, "skippipe averages the stage "
                          "replicas' gradients every step: dp_mode sync, no compression")
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings", True, "skippipe does not train tied "
                          "embeddings yet (the first and last stage's copies)")
    if m.n_experts:
        raise ConfigError("model.n_experts", m.n_experts, "skippipe trains dense models only")
    plain = {"train.recompute": (config.train.recompute, "none"),
             "data.packing": (config.data.packing, "concat"),
             "train.compile": (config.train.compile, False),
             "train.post_validation": (config.train.post_validation, False)}
    for name, (value, default) in plain.items():
        if value != default:
            raise ConfigError(name, value, f"skippipe does not run it yet; leave it {default!r}")
    if config.train.dtype == "bf16":
        raise ConfigError("train.dtype", "bf16", "skippipe keeps fp32 parameters: use fp32 or "
                          "bf16_autocast")
    if par.pp > m.n_layers:
        raise ConfigError("parallel.pp", par.pp, f"must not exceed model.n_layers = {m.n_layers}")


def _validate_offload(config: Config, schedule, how: str) -> None:
    """``parallel.schedule_offload_limit`` (PipeOffload): a limit the policy can meet on this
    schedule, and only what the runtime's offload is tested with (parity vs the same schedule
    without offload, ``tests/dist/test_pipeline_offload.py``): plain pipeline and data
    parallelism, fp32 or bf16 autocast, no recomputation, no other activation offload."""
    par, tr = config.parallel, config.train
    limit = par.schedule_offload_limit
    if limit < 2:
        raise ConfigError("parallel.schedule_offload_limit", limit,
                          "must be 0 (off) or >= 2 units (one microbatch's forward running and"
                          " one offload in flight)")
    untested = {"train.offload_activations": (tr.offload_activations, False),
                "train.recompute": (tr.recompute, "none"),
                "parallel.tp": (par.tp, 1), "parallel.cp": (par.cp, 1),
                "parallel.dp_shard": (par.dp_shard, 1), "parallel.ep": (par.ep, 1)}
    for name, (value, default) in untested.items():
        if value != default:
            raise ConfigError(name, value, "parallel.schedule_offload_limit does not compose with"
                              f" it yet; leave it {default!r} or the offload limit 0")
    if par.schedule.lower() == SEARCH:  # the search places the transfers itself, and finds a
        return  # schedule under any limit >= 1 unit (loom.schedule.select, offload_limit)
    try:
        insert_offload(schedule, limit)
    except ValueError as err:
        raise ConfigError("parallel.schedule_offload_limit", limit, f"{how}: {err}") from None


def validate_vocab_pp(config: Config) -> None:
    """``parallel.vocab_parallel_pp`` (loom/parallel/vocab_pipeline.py): the embedding and head
    split over pp ranks, as built and tested: pp > 1, the vocabulary divisible by pp x tp (the
    rows split over all pp x tp ranks; tp with or without sequence parallelism, whose split
    backwards the general SP rule below refuses), data parallelism over dp_replicate and
    dp_shard (the rows reduced as the stages' parameters: plain, or ZeRO-1/2/3 and HSDP on
    dp_shard, ``vocab_pipeline.data_parallel_rows``; tests/dist/test_vocab_pp_zero.py: fp32
    and bf16, tp, checkpoints, pretrained weights), cp in every cp_mode (the passes are per
    token: each cp coordinate's pipeline runs its own tokens', nothing crosses cp; the rows are
    averaged over dp x cp, ZeRO's over dp_shard x cp; tests/dist/test_vocab_pp_cp.py: ring
    and Ulysses in CI, all-gather, hybrid, ZeRO-1/3 and tp with and without SP in the
    matrix), MoE models with ep and ZeRO on dp_shard x ep (the rows stay dense, replicated
    over ep like every dense weight; tests/dist/test_pipeline_vocab.py, a checkpoint of
    vocab-pp x ep resharding to one process in test_vocab_pp_checkpoint.py), packed and varlen
    documents as well as concatenated
    rows (the passes are per token and the loss sums real targets only;
    tests/dist/test_documents_axes.py: 1F1B, ZB-V, and 1F1B x cp2 ring), one
    route, no offload or CheckFree. Composed and tested: an outer ``dp_mode`` (the rows
    averaged inside each replica, merged by the outer loop; tests/dist/test_outer_trainer.py),
    every train.dtype (fp32;
    bf16 parameters with fp32 masters; bf16 autocast), checkpoints and pretrained weights
    (each rank's rows saved at, and read from, their offset in the full weight:
    ``loom.train.checkpoint_state``, ``loom.parallel.load``), so any layout resumes them;
    under tp too, and tp with SP (tests/dist/test_pipeline_vocab_tp.py)."""
    par, m = config.parallel, config.model
    rule = "vocab_parallel_pp"
    if par.pp < 2:
        raise ConfigError(f"parallel.{rule}", True, "splits the vocabulary over pipeline ranks:"
                          f" needs parallel.pp > 1 (pp = {par.pp}); for tp use"
                          " parallel.vocab_parallel")
    shards = par.pp * par.tp
    if m.vocab_size % shards:
        raise ConfigError("model.vocab_size", m.vocab_size, f"must be divisible by parallel.pp x"
                          f" parallel.tp = {par.pp} x {par.tp} (parallel.vocab_parallel_pp splits"
                          " it evenly over every rank of a pipeline); nearest: "
                          + nearest_multiples(m.vocab_size, shards))
    plain = {"parallel.schedule_offload_limit":
             (par.schedule_offload_limit, 0.0), "fault.recovery": (config.fault.recovery,
                                                                   "checkpoint")}
    for name, (value, wanted) in plain.items():
        if value != wanted:
            raise ConfigError(name, value, f"parallel.{rule} runs with {name} = {wanted!r} only"
                              " (the combination is not built or tested)")
    if par.schedule.lower() == SKIPPIPE:
        raise ConfigError("parallel.schedule", par.schedule, f"parallel.{rule} places its passes"
                          " in a schedule's action lists; skippipe runs paths")


def validate_step_size(config: Config) -> None:
    """A pipeline step of at most ``MAX_STEP_CELLS`` (stage, microbatch) pairs: pp x m x the
    stages per rank (the search's most, ``MAX_CHUNKS``; a family's default: 2 at most). Public
    for the planner, which checks it at a layout's own microbatch count."""
    par = config.parallel
    if par.pp == 1 or par.schedule.lower() == SKIPPIPE:
        return
    micro, how = _microbatches(config)
    per_rank = par.chunks or (MAX_CHUNKS if par.schedule.lower() == SEARCH else 2)
    if par.pp * micro * per_rank > MAX_STEP_CELLS:
        raise ConfigError("parallel.pp", par.pp, f"with {how} and up to {per_rank} stages per rank"
                          f" the step is {par.pp * micro * per_rank:,} (stage, microbatch) pairs;"
                          f" at most {MAX_STEP_CELLS:,} (each is built and checked in Python:"
                          " minutes beyond): fewer microbatches (a larger micro_batch_size) or"
                          " fewer stages")


def validate_schedule(config: Config) -> None:
    """The pipeline rules: a known schedule family, chunks it accepts, a layer per stage and a
    microbatch count m = global_batch_size / (dp * micro_batch_size) (varlen: in tokens) the
    family can schedule."""
    par, m = config.parallel, config.model
    if par.vocab_parallel_pp:
        validate_vocab_pp(config)
    if par.schedule_offload_limit and (par.pp == 1 or par.schedule.lower() == SKIPPIPE):
        raise ConfigError("parallel.schedule_offload_limit", par.schedule_offload_limit,
                          "offloads inside a pipeline schedule: needs parallel.pp > 1 and a"
                          " schedule family or search (skippipe runs paths, not a schedule);"
                          " leave it 0")
    if par.schedule.lower() == SKIPPIPE:
        _validate_skippipe(config)
        return
    if par.skip_ratio or par.stage_replicas != 1:
        field_name = "parallel.skip_ratio" if par.skip_ratio else "parallel.stage_replicas"
        raise ConfigError(field_name, getattr(config.parallel, field_name.split(".")[1]),
                          "needs parallel.schedule = \"skippipe\"")
    if par.schedule.lower().replace("-", "_") in simulation_only():
        raise ConfigError("parallel.schedule", par.schedule,
                          "simulation only: its microbatches take two routes through two copies"
                          " of the model, which the pipeline runtime does not run (one copy per"
                          " stage, no gradient sum between copies); use it with loom schedule"
                          " show|simulate, and train with zbv, dualpipev or 1f1b")
    known = [*trainable(), SEARCH, SKIPPIPE]
    if par.schedule.lower() == SEARCH:
        if par.schedule_memory_limit and par.schedule_memory_limit < 1:
            raise ConfigError("parallel.schedule_memory_limit", par.schedule_memory_limit,
                              "must be 0 (pp units, what 1F1B needs) or >= 1 unit (one"
                              " microbatch's activations of one stage)")
        try:
            parse_search_costs(par.schedule_costs, par.pp)
        except ValueError as err:
            raise ConfigError("parallel.schedule_costs", par.schedule_costs, str(err)) from None
        if par.schedule_placement not in ("auto", *SEARCH_PLACEMENTS):
            raise ConfigError("parallel.schedule_placement", par.schedule_placement,
                              f"must be auto, {', '.join(SEARCH_PLACEMENTS)}")
        if par.schedule_placement not in ("auto", "looped") and m.n_layers < 2 * par.pp:
            raise ConfigError("parallel.schedule_placement", par.schedule_placement,
                              f"puts two stages on each rank: needs 2 x pp = {2 * par.pp} layers,"
                              f" the model has {m.n_layers}")
    elif par.schedule_placement != "auto":
        raise ConfigError("parallel.schedule_placement", par.schedule_placement,
                          "only schedule = \"search\" takes a placement (a family has its own);"
                          " leave it \"auto\"")
    if par.schedule.lower().replace("-", "_") not in known:
        raise ConfigError("parallel.schedule", par.schedule, f"unknown schedule; known: "
                          f"{', '.join(known)}" + suggest(par.schedule.lower(), known))
    if par.chunks < 0:
        raise ConfigError("parallel.chunks", par.chunks, "must be >= 0 (0: the family's default)")
    if par.pp == 1:
        default = DEFAULT_SCHEDULE
        if par.schedule.lower().replace("-", "_") != default:
            raise ConfigError("parallel.schedule", par.schedule, "needs parallel.pp > 1 (with pp"
                              f" = 1 there is no pipeline to schedule); set parallel.pp or leave"
                              f" the default {default!r}")
        if par.chunks:
            raise ConfigError("parallel.chunks", par.chunks, "needs parallel.pp > 1 (stages per"
                              " pipeline rank; with pp = 1 there is no pipeline); leave it 0")
        return
    validate_step_size(config)
    micro, how = _microbatches(config)
    try:
        schedule = schedule_for(par.schedule, par.pp, micro, par.chunks,
                                memory_limit=par.schedule_memory_limit, costs=par.schedule_costs,
                                placement=par.schedule_placement, max_stages=m.n_layers)
    except ChunksError as err:  # the family has a fixed number of stages per rank
        raise ConfigError("parallel.chunks", par.chunks, str(err)) from None
    except ValueError as err:
        raise ConfigError("parallel.schedule", par.schedule, f"{how}: {err}") from None
    model_stages = schedule.stages_per_route  # a bidirectional schedule holds 2 model copies
    if model_stages > m.n_layers:
        field_name, value = (("parallel.chunks", par.chunks) if par.chunks
                             else ("parallel.schedule", par.schedule))
        copies = f" / {schedule.num_routes} copies" if schedule.num_routes > 1 else ""
        raise ConfigError(field_name, value,
                          f"{model_stages} stages (pp = {par.pp} x"
                          f" {schedule.chunks_per_rank} per rank{copies}) need model.n_layers >="
                          f" {model_stages}, got {m.n_layers} (one layer per stage)")
    steps = model_stages * (m.n_layers - model_stages + 1) ** 2
    if steps > MAX_PARTITION_STEPS:
        raise ConfigError("model.n_layers", m.n_layers,
                          f"split over {model_stages} pipeline stages, the exact layer partition"
                          f" takes {steps:.1e} steps (minutes); at most {MAX_PARTITION_STEPS:.0e}"
                          " (stages x (layers - stages + 1)^2): fewer layers or more stages")
    if schedule.num_routes > 1 and par.vocab_parallel_pp:
        raise ConfigError("parallel.schedule", par.schedule, "parallel.vocab_parallel_pp needs one"
                          " route through the stages (the output layer follows the last stage);"
                          f" {par.schedule} has {schedule.num_routes}")
    if schedule.num_routes > 1:
        _validate_routes(config, schedule, how)
    if par.schedule_offload_limit:
        _validate_offload(config, schedule, how)
    if m.tie_embeddings and not par.vocab_parallel_pp:  # (vocab-pp: each shard ties its rows)
        _validate_tied_pipeline(config, schedule)


__all__ = ["DEFAULT_SCHEDULE", "CHECKFREE_SCHEDULES", "validate_fault", "validate_schedule",
           "validate_step_size", "validate_vocab_pp", "validate_zero_pipeline"]
