"""Cross-field rules of Loom's config: what ``validate`` checks before any process starts.

``loom.config`` owns the schema (dataclasses, parsing, TOML); this module owns the rules that tie
fields together: the world equals the product of the parallel degrees; heads, KV heads, layers,
vocabulary, sequence and batch are divisible by the degrees that split them; and the combinations
this version of Loom does not run yet are refused by name. Last, the few rules that look at files
(cheaply, writing nothing): ``checkpoint.resume`` is a committed checkpoint with a readable
manifest, and ``data.source`` holds a readable text file and enough text for one sample
(``loom.data.loader.check_source``). Every rule raises ``ConfigError`` naming the field, the value
and the rule, and the nearest valid value where one exists.

Split out of ``config.py`` so that a parallelism landing edits its own rule here, next to its
neighbours, without touching parsing; and split again along concepts as it grew: the data
path's rules live in ``data.py`` (packing, varlen budgets, documents on each layout), the
pipeline's in ``pipeline.py`` (schedules, tied embeddings and routes across stages, SkipPipe,
CheckFree), the shared helpers in ``common.py``; this module runs them all (``validate``) and
keeps the rules of the model's shape and of each parallelism. The arrow points one way: ``loom.config`` imports these
rules (``resolve`` runs them); they read a config's fields and import only its type names, for
annotations.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from loom.config_rules.common import nearest_multiples, require_divisible, require_positive
from loom.config_rules.data import (check_bpe_vocab, validate_packing, validate_varlen_batch,
                                    varlen_budgets)
from loom.config_rules.pipeline import (CHECKFREE_SCHEDULES, DEFAULT_SCHEDULE, validate_fault,
                                        validate_schedule, validate_zero_pipeline)
from loom.data.corpus import STDLIB_SOURCE
from loom.data.tokenizer import tokenizer_vocab_size
from loom.errors import ConfigError, path_error, shortened, suggest
from loom.layout import FP8_RECIPES, CPLayout, check_layout
from loom.models.args import MAX_LAYERS, MAX_SEQ_LEN

if TYPE_CHECKING:  # the rules read a config; loom.config imports them to run them in resolve()
    from loom.config import Config


# Bounds far beyond any real run that keep hostile values from hanging the checks (the memory
# estimators walk the layers and the microbatches one by one)
# The fields that name a file or directory: each is checked to be a path the kernel can take
PATH_FIELDS = ("model.init_from", "train.run_dir", "data.source", "data.tokenizer",
               "checkpoint.resume")
MAX_MICROBATCHES = 1_000_000  # per rank and optimizer step
MAX_SECONDS = 1e9  # a timeout or grace period (31 years; Python's timedelta ends near 8.6e13 s)
MAX_THREADS = 4096  # intra-op threads per rank


def validate_model_shape(config: Config) -> None:
    """The model section's own rules, which need no world size: what ``validate`` checks first
    and what the planner checks of a config file's model."""
    m = config.model
    require_positive(config, ["model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                               "model.ffn_dim", "model.vocab_size", "model.max_seq_len",
                               "model.vocab_multiple"])
    if m.n_layers > MAX_LAYERS:
        raise ConfigError("model.n_layers", m.n_layers, f"must be <= {MAX_LAYERS:,}")
    if m.max_seq_len > MAX_SEQ_LEN:
        raise ConfigError("model.max_seq_len", m.max_seq_len, f"must be <= {MAX_SEQ_LEN:,}"
                          " (every rank builds RoPE tables of that many positions)")
    require_divisible("model.n_heads", m.n_heads, m.n_kv_heads, "model.n_kv_heads")
    if not (math.isfinite(m.norm_eps) and m.norm_eps > 0):  # RMSNorm: x / sqrt(mean(x^2) + eps)
        raise ConfigError("model.norm_eps", m.norm_eps, "must be a finite number > 0")
    _validate_attention(config)


def validate(config: Config, world_size: int) -> None:
    """Check every cross-field rule; raise ConfigError naming the first broken one."""
    m, par, tr, data, opt = config.model, config.parallel, config.train, config.data, config.optim
    validate_model_shape(config)
    for field in PATH_FIELDS:  # before any rule or check below touches the file system
        section, key = field.split(".")
        value = getattr(getattr(config, section), key)
        why = path_error(value)
        if why:
            raise ConfigError(field, shortened(value), why)
    require_positive(config, ["train.steps", "train.global_batch_size",
                               "train.micro_batch_size", "train.eval_batches", "data.seq_len",
                               "data.bpe_vocab_size", "metrics.log_every"])
    require_positive(config, ["train.eval_every", "train.grad_clip", "train.threads",
                               "train.max_skipped_steps",
                               "data.max_bytes", "checkpoint.interval", "checkpoint.keep",
                               "optim.warmup_steps",
                               "optim.weight_decay", "optim.eps"], minimum=0)
    if opt.lr <= 0:
        raise ConfigError("optim.lr", opt.lr, "must be > 0")
    if not 0 <= opt.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", opt.min_lr_ratio, "must be in [0, 1]")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(opt, key) < 1:
            raise ConfigError(f"optim.{key}", getattr(opt, key), "must be in [0, 1)")
    if not 0 < data.val_fraction < 1:
        raise ConfigError("data.val_fraction", data.val_fraction, "must be in (0, 1)")
    check_bpe_vocab(data)
    validate_packing(config)
    _validate_resume(config.checkpoint.resume)
    for key, seconds in (("train.timeout_s", tr.timeout_s),
                         ("train.preempt_grace_s", tr.preempt_grace_s)):
        if not 0 < seconds <= MAX_SECONDS:
            raise ConfigError(key, seconds, f"must be > 0 and <= {MAX_SECONDS:g} seconds")
    if tr.seed < 0:  # numpy's and the samplers' seeds are non-negative
        raise ConfigError("train.seed", tr.seed, "must be >= 0")
    if tr.threads > MAX_THREADS:
        raise ConfigError("train.threads", tr.threads, f"must be <= {MAX_THREADS} (0: cores /"
                          " local ranks)")

    # Model shape (beyond validate_model_shape).
    if data.seq_len > m.max_seq_len:
        raise ConfigError("data.seq_len", data.seq_len,
                          f"must not exceed model.max_seq_len = {m.max_seq_len}")

    needed = tokenizer_vocab_size(data.tokenizer, data.bpe_vocab_size)
    if m.vocab_size < needed:
        raise ConfigError("model.vocab_size", m.vocab_size,
                          f"must be >= the {data.tokenizer} tokenizer's vocabulary ({needed})")

    # Parallel layout.
    degrees = par.degrees()
    product = math.prod(degrees.values())
    if product != world_size:
        raise ConfigError("parallel", degrees,
                          f"the product of the degrees ({product}) must equal the world size"
                          f" ({world_size} processes)")
    require_divisible("model.n_heads", m.n_heads, par.tp, "parallel.tp")
    require_divisible("model.n_kv_heads", m.n_kv_heads, par.tp, "parallel.tp")
    require_divisible("model.ffn_dim", m.ffn_dim, par.tp, "parallel.tp")
    if par.vocab_parallel:
        require_divisible("model.vocab_size", m.vocab_size, par.tp,
                           "parallel.tp (vocab_parallel splits the vocabulary)")
    elif m.tie_embeddings and par.tp > 1:
        raise ConfigError("parallel.vocab_parallel", False, "tied embeddings under tp > 1 need"
                          " vocab_parallel = true (embedding and head split the same way)")
    _validate_context_parallel(config)
    _validate_experts(config)
    if par.sequence_parallel and par.tp > 1:
        require_divisible("data.seq_len", data.seq_len // par.cp, par.tp,
                           "parallel.tp (sequence parallelism splits each cp shard)")
    if par.pp > m.n_layers:
        raise ConfigError("parallel.pp", par.pp,
                          f"must not exceed model.n_layers = {m.n_layers} (one layer per stage)")

    validate_batch(config)
    validate_schedule(config)

    # What this version of Loom runs: each later parallelism lifts its own rule when it lands.
    _validate_zero(config)
    _validate_post_validation(config)
    _validate_outer(config)
    _validate_compression(config)
    _validate_bf16(config)
    _validate_compile(config)
    _validate_fp8(config)
    if tr.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError("train.backend", tr.backend, "must be one of auto, gloo, nccl")
    if not (tr.device in ("auto", "cpu") or tr.device.startswith(("cuda", "xpu", "mps"))):
        raise ConfigError("train.device", tr.device, "must be auto, cpu, cuda or cuda:N")
    if tr.backend == "nccl" and tr.device == "cpu":
        raise ConfigError("train.backend", tr.backend, "nccl needs a GPU device, not train.device=cpu")
    _validate_metrics(config)
    validate_fault(config)

    _validate_init_from(config)
    # Last, as it looks at files: a corpus with text enough for one sample (not tokenized).
    if data.mix or str(data.source) != STDLIB_SOURCE:
        from loom.data.loader import check_source  # torch; the stdlib corpus needs no check
        check_source(data)


def validate_batch(config: Config) -> None:
    """The batch rules (varlen: in tokens, ``validate_varlen_batch``): the global batch splits
    evenly over the data ranks and their microbatches, and gives at most ``MAX_MICROBATCHES``
    per rank and step. Public for the planner, which checks them at a layout's real microbatch
    count while it validates the rest with a smaller one (``loom.plan.search.runnable``)."""
    data, tr, par = config.data, config.train, config.parallel
    if data.packing == "varlen":
        validate_varlen_batch(config)
        return
    require_divisible("train.global_batch_size", tr.global_batch_size, par.dp,
                      "the data-parallel degree dp_replicate*dp_shard*ep")
    local_batch = tr.global_batch_size // par.dp
    if local_batch % tr.micro_batch_size:
        raise ConfigError("train.micro_batch_size", tr.micro_batch_size,
                          f"must divide the per-rank batch global_batch_size / dp ="
                          f" {tr.global_batch_size} / {par.dp} = {local_batch}")
    if local_batch // tr.micro_batch_size > MAX_MICROBATCHES:
        raise ConfigError("train.global_batch_size", tr.global_batch_size,
                          f"gives {local_batch // tr.micro_batch_size:,} microbatches per rank"
                          f" and step (/ dp {par.dp} / micro_batch_size"
                          f" {tr.micro_batch_size}); at most {MAX_MICROBATCHES:,}")


def _validate_attention(config: Config) -> None:
    """Heads, head size and the attention variants of ``TransformerArgs`` (model families)."""
    m = config.model
    require_positive(config, {"model.head_dim_override": "0: dim / n_heads"}, minimum=0)
    if m.head_dim_override == 0:
        require_divisible("model.dim", m.dim, m.n_heads, "model.n_heads")
        if m.head_dim % 2:
            raise ConfigError("model.dim", m.dim, f"dim / n_heads = {m.head_dim} must be even"
                              " (RoPE rotates pairs of channels)")
    elif m.head_dim_override % 2:
        raise ConfigError("model.head_dim_override", m.head_dim_override,
                          "must be even (RoPE rotates pairs of channels)")
    require_positive(config, {"model.sliding_window": "0: full causal attention"}, minimum=0)
    if not m.rope_theta > 0:
        raise ConfigError("model.rope_theta", m.rope_theta, "must be > 0")
    if m.rope_scaling != "none" and not m.rope_scaling_factor > 0:
        raise ConfigError("model.rope_scaling_factor", m.rope_scaling_factor,
                          f"must be > 0 (rope_scaling = {m.rope_scaling!r} divides by it)")
    if m.rope_scaling == "llama3":
        if m.rope_scaling_original_max_len < 1:
            raise ConfigError("model.rope_scaling_original_max_len",
                              m.rope_scaling_original_max_len, "must be >= 1 with rope_scaling ="
                              " 'llama3' (the original training context, 8192 for Llama 3.1)")
        if not 0 < m.rope_scaling_low_freq_factor < m.rope_scaling_high_freq_factor:
            raise ConfigError("model.rope_scaling_low_freq_factor", m.rope_scaling_low_freq_factor,
                              "must be > 0 and < model.rope_scaling_high_freq_factor ="
                              f" {m.rope_scaling_high_freq_factor} (llama3 blends between them)")


def _validate_init_from(config: Config) -> None:
    """Nothing under ``model.init_from`` is ever written: the run directory (by default
    ``runs/<time>`` under the working directory) must lie outside it."""
    source = config.model.init_from
    if not source:
        return
    run_dir = Path(config.train.run_dir or "runs").resolve()
    if run_dir == Path(source).resolve() or Path(source).resolve() in run_dir.parents:
        raise ConfigError("train.run_dir", config.train.run_dir or "runs/<time>",
                          f"lies inside model.init_from ({source}), which is never written to;"
                          " choose a run directory outside it")


def _validate_fp8(config: Config) -> None:
    """``train.fp8`` (torchao's float8 matmuls in the blocks' linears, loom/parallel/fp8.py): a
    known recipe, and what is not built with it yet. Whether the machine has torchao and FP8
    matmuls is not the config's business: ``fp8.device_refusal``, asked by ``loom train``
    before launching (the planner writes configs for machines it is not on)."""
    tr = config.train
    if tr.fp8 not in FP8_RECIPES:
        raise ConfigError("train.fp8", tr.fp8, f"must be one of {', '.join(FP8_RECIPES)}"
                          + suggest(str(tr.fp8), list(FP8_RECIPES)))
    par = config.parallel
    if tr.fp8_all_gather:
        if tr.fp8 != "tensorwise":
            raise ConfigError("train.fp8_all_gather", True, "gathers weights cast to float8"
                              " with one scale per tensor: torchao builds it for train.fp8 ="
                              f" tensorwise only, not {tr.fp8!r}")
        if par.dp_shard == 1 or par.zero_stage != 3:
            raise ConfigError("train.fp8_all_gather", True, "is ZeRO-3's all-gather of the"
                              " weights (FSDP2): needs parallel.dp_shard > 1 with zero_stage = 3"
                              f" (here dp_shard = {par.dp_shard}, zero_stage ="
                              f" {par.zero_stage})")
        if par.tp > 1:
            raise ConfigError("train.fp8_all_gather", True, f"with parallel.tp = {par.tp} > 1"
                              " is not built (the float8 gather of 2-D sharded weights is not"
                              " proven against one process here); use tp = 1")
        if tr.offload_optimizer:
            raise ConfigError("train.fp8_all_gather", True, "with train.offload_optimizer is not"
                              " built (the shards and their amaxes' all-reduce would be on the"
                              " host, and offload is a no-op on the CPU where the float8"
                              " gather is proven); leave one of them off")
    if tr.fp8 == "none":
        if tr.fp8_emulate:
            raise ConfigError("train.fp8_emulate", True, "emulates train.fp8's matmuls: set"
                              " train.fp8 to a recipe, or leave fp8_emulate false")
        return
    if par.cp > 1 and tr.fp8 != "rowwise_with_gw_hp":
        raise ConfigError("train.fp8", tr.fp8, f"with parallel.cp = {par.cp} > 1"
                          " would scale over each rank's part of the sequence (a whole tensor's"
                          " or a column's amax over the tokens), so results would change with"
                          " cp: use rowwise_with_gw_hp, whose scales are per token or per weight"
                          " row")


def _validate_compile(config: Config) -> None:
    """``train.compile`` (torch.compile per block, loom/parallel/compile.py): composes with
    every layout (an MoE block compiles its attention and norms, its MoE layer stays eager);
    refused where the compiled blocks would quietly run eagerly."""
    if not config.train.compile:
        return
    if config.data.packing == "varlen" and config.parallel.tp > 1:
        raise ConfigError("train.compile", True, "with data.packing = varlen and parallel.tp ="
                          f" {config.parallel.tp} > 1 is not built: varlen compiles the blocks"
                          " for a symbolic sequence length, and tp's DTensor blocks traced"
                          " that way exceed the recursion limit in torch 2.13's dynamo; use"
                          " compile = false or tp = 1")
    if config.metrics.comm and config.parallel.tp > 1:
        raise ConfigError("metrics.comm", True, "with train.compile = true and parallel.tp ="
                          f" {config.parallel.tp} > 1: tensor parallelism's collectives are"
                          " counted by a TorchDispatchMode, under which torch.compile runs the"
                          " blocks eagerly; turn one of them off")


def _validate_metrics(config: Config) -> None:
    """The stated MFU peak, the profiled steps and the experiment tracker (whose package must be
    installed: checked here, before launch, rather than by a worker's failed import)."""
    mc, steps = config.metrics, config.train.steps
    require_positive(config, {"metrics.peak_tflops": "0: the catalog's peak of a known GPU,"
                                                     " else MFU is n/a"}, minimum=0)
    if mc.profile_steps:
        shown = ",".join(map(str, mc.profile_steps))
        rule = (f"must be A,B: the first and last step to trace, inclusive (or one step A), with"
                f" 1 <= A <= B <= train.steps = {steps}")
        first, last = mc.profile_steps[0], mc.profile_steps[-1]
        if len(mc.profile_steps) > 2 or not 1 <= first <= last <= steps:
            raise ConfigError("metrics.profile_steps", shown, rule)
    if mc.wandb:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("metrics.wandb", True, "needs the wandb package, which is not"
                              " installed: pip install 'loom[wandb]' (or wandb>=0.17)")
        if not mc.wandb_project.strip():
            raise ConfigError("metrics.wandb_project", mc.wandb_project,
                              "must name a W&B project when metrics.wandb = true")


def _validate_resume(resume: str) -> None:
    """``checkpoint.resume``: '', 'auto', 'auto_or_fresh' or a committed checkpoint directory
    whose manifest is there and readable (a cheap look at its structure: ``checkpoint.verify``
    checks every file against it when the run loads it)."""
    if resume in ("", "auto", "auto_or_fresh"):
        return
    path = Path(resume)
    rule = "must be '', 'auto', 'auto_or_fresh' or a complete checkpoint directory"
    if not path.is_dir():
        raise ConfigError("checkpoint.resume", resume, f"{rule}: not a directory")
    if not (path / "COMMITTED").is_file():
        raise ConfigError("checkpoint.resume", resume, f"{rule}: no COMMITTED marker (the save"
                          " did not finish)")
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise ConfigError("checkpoint.resume", resume, f"{rule}: no manifest.json")
    try:
        table = json.loads(manifest.read_bytes())
    except (OSError, ValueError, RecursionError) as err:  # bad JSON, not UTF-8, absurdly deep
        raise ConfigError("checkpoint.resume", resume,
                          f"{rule}: manifest.json is unreadable ({err})") from None
    if not isinstance(table, dict) or not isinstance(table.get("files"), dict):
        raise ConfigError("checkpoint.resume", resume,
                          f"{rule}: manifest.json has no \"files\" table")


def _validate_zero(config: Config) -> None:
    """ZeRO / FSDP, recomputation and memory rules (the combinations not built yet are named)."""
    par, tr = config.parallel, config.train
    if par.zero_stage not in (1, 2, 3):
        raise ConfigError("parallel.zero_stage", par.zero_stage, "must be 1, 2 or 3")
    require_positive(config, ["train.recompute_every"])
    require_positive(config, {"train.memory_limit_gb": "0: the device's memory,"
                                                       " or no check on CPU"}, minimum=0)
    if tr.offload_optimizer and par.dp_shard == 1:
        raise ConfigError("train.offload_optimizer", True, "needs a sharded optimizer:"
                          " parallel.dp_shard > 1 (ZeRO keeps its shard on the host)")
    if not tr.grad_bucket_mb > 0:
        raise ConfigError("train.grad_bucket_mb", tr.grad_bucket_mb, "must be > 0 (MiB)")
    if tr.grad_reduce_every_microbatch:
        if par.dp_shard == 1 or par.zero_stage == 1:
            raise ConfigError("train.grad_reduce_every_microbatch", True,
                              "saves memory only where gradients are sharded: needs"
                              " parallel.dp_shard > 1 with zero_stage = 2 or 3")
        if par.pp > 1:
            raise ConfigError("train.grad_reduce_every_microbatch", True,
                              "not with pp > 1: pipeline stages reduce once, after their last"
                              " backward piece of the step")
    if par.dp_shard == 1:
        return
    # cp > 1 composes: ZeRO shards over dp_shard x cp (cp ranks hold the same weights).
    # MoE composes: with ep = 1 experts are ordinary parameters; with ep > 1 dense weights shard
    # over dp_shard x ep (x cp), experts over dp_shard (x cp) (parity tests:
    # tests/dist/test_zero_expert.py, with dp_replicate, tp, cp and pp).
    if par.pp > 1:
        validate_zero_pipeline(config)


def _validate_post_validation(config: Config) -> None:
    """The post-validated optimizer step rolls back what the optimizer stepped: parameters or
    their shards (plain, dp, tp, ep, pp, FSDP2; tp, ep and FSDP2 sum the norm's squares over
    their groups first, blocking), not ZeRO-1/2's slices, whose step also re-gathers them."""
    par = config.parallel
    if not config.train.post_validation:
        return
    if par.dp_shard > 1 and par.zero_stage in (1, 2):
        raise ConfigError("train.post_validation", True,
                          f"not implemented with ZeRO-{par.zero_stage} (dp_shard ="
                          f" {par.dp_shard}: its optimizer steps slices and re-gathers the"
                          " parameters inside its step); use zero_stage = 3 or"
                          " train.post_validation = false")
    if par.dp_mode != "sync":
        raise ConfigError("train.post_validation", True,
                          f"not implemented with parallel.dp_mode = {par.dp_mode} (each replica's"
                          " gradient norm is its own, and the replicas must agree on a"
                          " non-finite step before the mean starts); use"
                          " train.post_validation = false")


def _validate_outer(config: Config) -> None:
    """Outer-loop data parallelism (``parallel.dp_mode``, ``loom.parallel.outer``): the outer
    optimizer's knobs are checked whatever the mode (a bad value is refused before it matters),
    and an outer mode needs replicas and a layout whose gradient reduction this version keeps
    inside a replica (dp_shard, ep and cp; never dp_replicate)."""
    par = config.parallel
    require_positive(config, {"parallel.outer_steps": "H: inner optimizer steps per outer step"})
    if not par.outer_lr > 0:
        raise ConfigError("parallel.outer_lr", par.outer_lr, "must be > 0")
    if not 0 <= par.outer_momentum < 1:
        raise ConfigError("parallel.outer_momentum", par.outer_momentum, "must be in [0, 1)")
    require_positive(config, {"parallel.outer_fragments": "1: the whole model at once"})
    require_positive(config, dict.fromkeys(["parallel.co2_gap_penalty", "parallel.co2_clip",
                                            "parallel.noloco_consensus"], "0: off"), minimum=0)
    if par.dp_mode == "sync":
        return
    if par.dp_replicate < 2:
        raise ConfigError("parallel.dp_mode", par.dp_mode,
                          f"needs parallel.dp_replicate >= 2: the outer loop merges replicas,"
                          f" and dp_replicate = {par.dp_replicate} is one; set dp_replicate or"
                          " use dp_mode = sync")
    if par.outer_fragments > 1 and par.dp_mode != "diloco":
        raise ConfigError("parallel.outer_fragments", par.outer_fragments,
                          f"streaming (fragments > 1) applies to dp_mode = diloco only, not"
                          f" {par.dp_mode}; use 1")
    if par.outer_fragments > par.outer_steps:
        raise ConfigError("parallel.outer_fragments", par.outer_fragments,
                          f"must be <= parallel.outer_steps = {par.outer_steps}: each fragment"
                          f" merges at its own inner step of the window")
    # ZeRO-1/2: the outer loop merges each rank's owned slices (on the device: an offloaded
    # optimizer's slices live on the host, where the replica group's collectives are not built)
    if par.dp_shard > 1 and par.zero_stage in (1, 2) and config.train.offload_optimizer:
        raise ConfigError("train.offload_optimizer", True,
                          f"ZeRO-{par.zero_stage} with dp_mode = {par.dp_mode} merges the"
                          " optimizer's slices across replicas on the device; an offloaded"
                          " optimizer keeps them on the host: use offload_optimizer = false")


def _validate_compression(config: Config) -> None:
    """Gradient compression (``parallel.grad_compression``, ``loom.parallel.compression``): its
    knobs are checked whatever the mode; it is a step of the plain data-parallel reducer's
    all-reduce, so it is refused where gradients take another path."""
    par, tr = config.parallel, config.train
    require_positive(config, {"parallel.compression_rank": "PowerSGD's rank"})
    if not 0 < par.compression_topk_ratio <= 1:
        raise ConfigError("parallel.compression_topk_ratio", par.compression_topk_ratio,
                          "must be in (0, 1] (the fraction of each tensor's elements sent)")
    require_positive(config, {"parallel.compression_refresh": "steps between L-GreCo's choices"})
    if par.compression_adaptive != "none" and par.grad_compression not in ("powersgd", "topk"):
        raise ConfigError("parallel.compression_adaptive", par.compression_adaptive,
                          f"needs a base compressor with levels to choose from:"
                          f" parallel.grad_compression = powersgd or topk, not"
                          f" {par.grad_compression}")
    if par.grad_compression == "none":
        return
    if par.dp_shard > 1:
        raise ConfigError("parallel.grad_compression", par.grad_compression,
                          f"not defined with ZeRO (dp_shard = {par.dp_shard}, zero_stage ="
                          f" {par.zero_stage}): its gradients are reduce-scattered into shards,"
                          " not all-reduced by the reducer compression plugs into; use"
                          " dp_shard = 1 or grad_compression = none")
    if par.dp_mode != "sync":
        raise ConfigError("parallel.grad_compression", par.grad_compression,
                          f"compresses synchronous data parallelism's gradients; dp_mode ="
                          f" {par.dp_mode} merges weights in an outer loop instead; use"
                          " dp_mode = sync or grad_compression = none")
    if tr.grad_reduce_dtype != "fp32":
        raise ConfigError("train.grad_reduce_dtype", tr.grad_reduce_dtype,
                          f"parallel.grad_compression = {par.grad_compression} sends its own"
                          " format (fp32 factors, int8, or values and indices); use fp32")


def _validate_bf16(config: Config) -> None:
    """``train.dtype = bf16`` (bf16 parameters, fp32 masters: ``loom.parallel.mixed_precision``,
    ``zero.py``, FSDP2) with what it is not built for yet: each of these reads or writes the
    parameters' gradients or values outside the master-weight path; bf16_autocast runs them."""
    tr = config.train
    if tr.dtype != "bf16":
        return
    unbuilt = [  # (refused when, the combination, why, the other way out)
        (tr.offload_optimizer, "train.offload_optimizer",
         "the fp32 master slices stay on the device", "offload_optimizer = false"),
    ]
    for refused, combination, why, other in unbuilt:
        if refused:
            raise ConfigError("train.dtype", tr.dtype,
                              f"bf16 parameters with {combination} are not built ({why}); use"
                              f" train.dtype = bf16_autocast (fp32 parameters) or {other}")


def _validate_experts(config: Config) -> None:
    """MoE shape rules, and what expert parallelism composes with in this version."""
    m, par = config.model, config.parallel
    require_positive(config, {"model.n_experts": "0: a dense model"}, minimum=0)
    if m.n_experts == 0:
        if par.ep > 1:
            raise ConfigError("parallel.ep", par.ep, "expert parallelism needs an MoE model"
                              " (model.n_experts > 0); for data parallelism use dp_replicate")
        return
    if not 1 <= m.top_k <= m.n_experts:
        raise ConfigError("model.top_k", m.top_k, f"must be in [1, model.n_experts = {m.n_experts}]")
    require_positive(config, ["model.expert_ffn_dim", "model.n_shared_experts",
                              "model.n_dense_layers", "model.capacity_factor",
                              "model.aux_loss_coef"], minimum=0)
    require_positive(config, ["model.moe_every"])
    if not any(m.moe_layer(i) for i in range(m.n_layers)):
        raise ConfigError("model.n_dense_layers", m.n_dense_layers, "leaves no MoE layer"
                          f" (n_layers = {m.n_layers}, moe_every = {m.moe_every})")
    require_divisible("model.n_experts", m.n_experts, par.ep,
                       "parallel.ep (each ep rank holds n_experts / ep experts)")
    hidden = m.expert_ffn_dim or m.ffn_dim
    if hidden % par.tp:
        raise ConfigError("model.expert_ffn_dim" if m.expert_ffn_dim else "model.ffn_dim", hidden,
                          f"must be divisible by parallel.tp = {par.tp} (expert-TP = TP splits"
                          f" every expert's hidden dim); nearest valid:"
                          f" {nearest_multiples(hidden, par.tp)}")
    if par.cp > 1 and m.capacity_factor > 0:
        raise ConfigError("model.capacity_factor", m.capacity_factor, f"must be 0 (dropless)"
                          f" with parallel.cp = {par.cp}: capacity is per sequence, and a queue"
                          " position depends on the order of all of a sequence's tokens, which"
                          " cp splits over ranks")


def _validate_context_parallel(config: Config) -> None:
    """cp rules: the zig-zag ring needs seq_len divisible by 2*cp (cp for Ulysses alone); the
    Ulysses degree must divide cp and the heads each tp rank holds."""
    par, m = config.parallel, config.model
    require_positive(config, {"parallel.cp_ulysses": "0: automatic"}, minimum=0)
    if par.cp == 1:
        return

    if par.cp_mode == "hybrid" and par.cp_ulysses and par.cp % par.cp_ulysses:
        raise ConfigError("parallel.cp_ulysses", par.cp_ulysses,
                          f"must divide parallel.cp = {par.cp}")
    layout = CPLayout.from_mode(par.cp_mode, par.cp, par.cp_ulysses)
    try:
        check_layout(layout, config.data.seq_len, m.n_heads // par.tp, m.n_kv_heads // par.tp)
    except ValueError as err:
        field = "data.seq_len" if "seq_len" in str(err) else "parallel.cp"
        value = config.data.seq_len if field == "data.seq_len" else par.cp
        raise ConfigError(field, value, f"{err} (parallel.cp_mode={par.cp_mode})") from None


# --------------------------------------------------------------------------------------------
# Output


# what other modules import from here (the rule modules' public names stay reachable as before)
__all__ = ["validate", "DEFAULT_SCHEDULE", "CHECKFREE_SCHEDULES", "check_bpe_vocab",
           "varlen_budgets"]
