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
neighbours, without touching parsing. The arrow points one way: ``loom.config`` imports these
rules (``resolve`` runs them); they read a config's fields and import only its type names, for
annotations.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from loom.data.corpus import STDLIB_SOURCE
from loom.data.budgets import PACKINGS
from loom.data.tokenizer import tokenizer_vocab_size
from loom.data.budgets import BALANCES, token_budgets
from loom.errors import ConfigError, suggest
from loom.layout import CPLayout, check_layout
from loom.layout import FP8_RECIPES
from loom.schedule.families import SEARCH_PLACEMENTS, simulation_only, trainable
from loom.schedule.paths import SKIPPIPE, skip_count
from loom.schedule.select import ChunksError, SEARCH, parse_search_costs, schedule_for

if TYPE_CHECKING:  # the rules read a config; loom.config imports them to run them in resolve()
    from loom.config import Config, DataConfig

# parallel.schedule's default; with pp = 1 any other family is refused
DEFAULT_SCHEDULE = "1f1b"


def check_bpe_vocab(data: DataConfig) -> None:
    if data.tokenizer == "bpe" and data.bpe_vocab_size < 260:
        raise ConfigError("data.bpe_vocab_size", data.bpe_vocab_size,
                          "must be >= 260 (256 byte symbols plus special tokens)")


def _nearest_multiples(value: int, divisor: int) -> str:
    low = (value // divisor) * divisor
    options = [v for v in (low, low + divisor) if v > 0]
    return " or ".join(str(v) for v in options)


def _require_divisible(field_name: str, value: int, divisor: int, what: str) -> None:
    if divisor > 1 and value % divisor:
        raise ConfigError(field_name, value, f"must be divisible by {what} = {divisor};"
                          f" nearest valid: {_nearest_multiples(value, divisor)}")


def _require_positive(config: Config, keys: list[str], minimum: float = 1) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value < minimum:
            raise ConfigError(key, value, f"must be >= {minimum}")


def validate(config: Config, world_size: int) -> None:
    """Check every cross-field rule; raise ConfigError naming the first broken one."""
    m, par, tr, data, opt = config.model, config.parallel, config.train, config.data, config.optim
    _require_positive(config, ["model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                               "model.ffn_dim", "model.vocab_size", "model.max_seq_len",
                               "model.vocab_multiple", "train.steps", "train.global_batch_size",
                               "train.micro_batch_size", "train.eval_batches", "data.seq_len",
                               "data.bpe_vocab_size", "metrics.log_every"])
    _require_positive(config, ["train.eval_every", "train.grad_clip", "train.threads",
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
    _validate_packing(config)
    _validate_resume(config.checkpoint.resume)
    if tr.timeout_s <= 0:
        raise ConfigError("train.timeout_s", tr.timeout_s, "must be > 0")
    if tr.preempt_grace_s <= 0:
        raise ConfigError("train.preempt_grace_s", tr.preempt_grace_s, "must be > 0")

    # Model shape.
    _validate_attention(config)
    _require_divisible("model.n_heads", m.n_heads, m.n_kv_heads, "model.n_kv_heads")
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
    _require_divisible("model.n_heads", m.n_heads, par.tp, "parallel.tp")
    _require_divisible("model.n_kv_heads", m.n_kv_heads, par.tp, "parallel.tp")
    _require_divisible("model.ffn_dim", m.ffn_dim, par.tp, "parallel.tp")
    if par.vocab_parallel:
        _require_divisible("model.vocab_size", m.vocab_size, par.tp,
                           "parallel.tp (vocab_parallel splits the vocabulary)")
    elif m.tie_embeddings and par.tp > 1:
        raise ConfigError("parallel.vocab_parallel", False, "tied embeddings under tp > 1 need"
                          " vocab_parallel = true (embedding and head split the same way)")
    _validate_context_parallel(config)
    _validate_experts(config)
    if par.sequence_parallel and par.tp > 1:
        _require_divisible("data.seq_len", data.seq_len // par.cp, par.tp,
                           "parallel.tp (sequence parallelism splits each cp shard)")
    if par.pp > m.n_layers:
        raise ConfigError("parallel.pp", par.pp,
                          f"must not exceed model.n_layers = {m.n_layers} (one layer per stage)")

    # Batch (varlen: in tokens, _validate_varlen_batch).
    if data.packing == "varlen":
        _validate_varlen_batch(config)
    else:
        _require_divisible("train.global_batch_size", tr.global_batch_size, par.dp,
                           "the data-parallel degree dp_replicate*dp_shard*ep")
        local_batch = tr.global_batch_size // par.dp
        if local_batch % tr.micro_batch_size:
            raise ConfigError("train.micro_batch_size", tr.micro_batch_size,
                              f"must divide the per-rank batch global_batch_size / dp ="
                              f" {tr.global_batch_size} / {par.dp} = {local_batch}")
    _validate_schedule(config)

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
    _validate_fault(config)

    _validate_init_from(config)
    # Last, as it looks at files: a corpus with text enough for one sample (not tokenized).
    if data.mix or str(data.source) != STDLIB_SOURCE:
        from loom.data.loader import check_source  # torch; the stdlib corpus needs no check
        check_source(data)


CHECKFREE_SCHEDULES = ("1f1b", "gpipe")  # one stage per rank, every microbatch through all


def _validate_fault(config: Config) -> None:
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
        for name in ("test_kill_stage", "test_kill_stages"):
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
    if not kills:
        return
    name = "fault.test_kill_stages" if fault.test_kill_stages else "fault.test_kill_stage"
    low, high = (0, par.pp - 1) if plus else (1, par.pp - 2)
    for stage in kills:
        if not low <= stage <= high:
            raise ConfigError(name, stage, f"fault.recovery={fault.recovery} recovers stages"
                              f" {low}..{high}" + ("" if plus else "; the first and last stage"
                                                   " need checkfree_plus"))
    if not 1 <= fault.test_kill_step <= tr.steps:
        raise ConfigError("fault.test_kill_step", fault.test_kill_step,
                          f"must be in [1, train.steps = {tr.steps}]")
    if fault.test_kill_count < 1:
        raise ConfigError("fault.test_kill_count", fault.test_kill_count, "must be >= 1")


def _validate_packing(config: Config) -> None:
    """``data.packing``: a known mode; documents run on every axis (cp cuts them per
    document, ``_validate_context_documents``; tp, sequence parallelism, selective recompute
    and MoE all run: the attention core sees whole rows, MoE routes and balances per document,
    padding excluded)."""
    packing, par, tr = config.data.packing, config.parallel, config.train
    if packing not in PACKINGS:
        raise ConfigError("data.packing", packing, f"must be one of {', '.join(PACKINGS)}"
                          + suggest(str(packing), list(PACKINGS)))
    data = config.data
    for key, value in (("train.global_batch_tokens", tr.global_batch_tokens),
                       ("data.tokens_per_microbatch", data.tokens_per_microbatch)):
        if value < 0:
            raise ConfigError(key, value, "must be >= 0 (0: from the batch in sequences)")
        if value and packing != "varlen":
            raise ConfigError(key, value, "applies to data.packing = varlen only; leave it 0")
    if data.balance not in BALANCES:
        raise ConfigError("data.balance", data.balance, f"must be one of {', '.join(BALANCES)}"
                          + suggest(str(data.balance), list(BALANCES)))
    if data.balance != "none" and packing != "varlen":
        raise ConfigError("data.balance", data.balance, "deals the documents of varlen steps:"
                          " needs data.packing = varlen")
    if packing == "concat":
        return
    if packing == "varlen":
        _validate_varlen_layout(config)
    if par.cp > 1:  # documents cut per document over cp (loom.parallel.context_documents)
        _validate_context_documents(config)
    if config.model.n_experts and par.cp > 1:
        raise ConfigError("data.packing", packing, "MoE routes and balances each document as a"
                          f" whole; context parallelism (parallel.cp = {par.cp}) splits"
                          " documents over ranks: use cp = 1 with model.n_experts > 0")


def _validate_context_documents(config: Config) -> None:
    """pack/varlen under cp > 1: what is not built on top of it yet, by name."""
    packing, par = config.data.packing, config.parallel
    if par.tp > 1 and par.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", True, f"{packing} under cp ="
                          f" {par.cp} with sequence parallelism is not built yet (a cp shard"
                          " of documents is padded to the Ulysses degree, not to tp): turn it"
                          " off or use cp = 1")
    if par.dp_mode != "sync":
        raise ConfigError("parallel.dp_mode", par.dp_mode, f"{packing} under cp = {par.cp}"
                          " counts a step's tokens over dp x cp; the outer modes' replica"
                          " groups do not include cp yet: use dp_mode = sync or cp = 1")


def _validate_varlen_layout(config: Config) -> None:
    """What varlen microbatches (``loom.data.varlen``) do not run on yet, beyond ``pack``'s
    rules: mixed sources and compiled blocks (every microbatch has its own length)."""
    if config.data.mix:
        raise ConfigError("data.packing", "varlen", "varlen draws pieces of one token range;"
                          " data.mix is not built for it yet: use pack or concat with data.mix")
    if config.train.compile:
        raise ConfigError("data.packing", "varlen", "every varlen microbatch has its own length,"
                          " which train.compile would recompile for: use compile = false")


def varlen_budgets(config: Config) -> tuple[int, int]:
    """``(train.global_batch_tokens, data.tokens_per_microbatch)`` with 0 resolved."""
    tr, data = config.train, config.data
    return token_budgets(tr.global_batch_tokens, data.tokens_per_microbatch,
                         tr.global_batch_size, tr.micro_batch_size, data.seq_len)


def _validate_varlen_batch(config: Config) -> None:
    """Varlen's batch is in tokens: a microbatch holds any piece (``tokens_per_microbatch``
    >= ``seq_len``, the split length), and the step's microbatches ``global_batch_tokens /
    tokens_per_microbatch`` are shared equally by the data-parallel ranks."""
    par, data = config.parallel, config.data
    step, micro = varlen_budgets(config)
    if micro < data.seq_len:
        raise ConfigError("data.tokens_per_microbatch", micro,
                          f"must be >= data.seq_len = {data.seq_len}, the split length:"
                          " documents are cut into pieces of at most seq_len predictions and"
                          " each piece must fit in one microbatch")
    if step % (par.dp * micro):
        raise ConfigError("train.global_batch_tokens", step,
                          f"must be divisible by dp * data.tokens_per_microbatch = {par.dp} *"
                          f" {micro} (equal microbatch counts on every data-parallel rank);"
                          f" nearest valid: {_nearest_multiples(step, par.dp * micro)}")


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


def _validate_attention(config: Config) -> None:
    """Heads, head size and the attention variants of ``TransformerArgs`` (model families)."""
    m = config.model
    if m.head_dim_override < 0:
        raise ConfigError("model.head_dim_override", m.head_dim_override,
                          "must be >= 0 (0: dim / n_heads)")
    if m.head_dim_override == 0:
        _require_divisible("model.dim", m.dim, m.n_heads, "model.n_heads")
        if m.head_dim % 2:
            raise ConfigError("model.dim", m.dim, f"dim / n_heads = {m.head_dim} must be even"
                              " (RoPE rotates pairs of channels)")
    elif m.head_dim_override % 2:
        raise ConfigError("model.head_dim_override", m.head_dim_override,
                          "must be even (RoPE rotates pairs of channels)")
    if m.sliding_window < 0:
        raise ConfigError("model.sliding_window", m.sliding_window,
                          "must be >= 0 (0: full causal attention)")
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
    if tr.fp8 == "none":
        if tr.fp8_emulate:
            raise ConfigError("train.fp8_emulate", True, "emulates train.fp8's matmuls: set"
                              " train.fp8 to a recipe, or leave fp8_emulate false")
        return
    if config.parallel.tp > 1:
        raise ConfigError("train.fp8", tr.fp8, f"with parallel.tp = {config.parallel.tp} > 1 is"
                          " not built yet (torchao's float8 tensor-parallel styles would replace"
                          " Loom's TP plan): use tp = 1 with FP8, or train.fp8 = none")
    if config.parallel.cp > 1 and tr.fp8 != "rowwise_with_gw_hp":
        raise ConfigError("train.fp8", tr.fp8, f"with parallel.cp = {config.parallel.cp} > 1"
                          " would scale over each rank's part of the sequence (a whole tensor's"
                          " or a column's amax over the tokens), so results would change with"
                          " cp: use rowwise_with_gw_hp, whose scales are per token or per weight"
                          " row")


def _validate_compile(config: Config) -> None:
    """``train.compile`` (torch.compile per block, loom/parallel/compile.py): composes with
    every dense layout; refused where the compiled blocks would quietly run eagerly."""
    if not config.train.compile:
        return
    if config.model.n_experts > 0:
        # Measured on the debug MoE model: 2 steps 86 s compiled vs 10 s eager at ep = 1 and 2.
        raise ConfigError("train.compile", True, "is not built for MoE models (model.n_experts ="
                          f" {config.model.n_experts} > 0): the router's data-dependent shapes"
                          " (token counts per expert, all-to-all splits) break the graph and"
                          " recompile every batch until torch's recompile limit, after which the"
                          " blocks run eagerly; use train.compile = false")
    if config.metrics.comm and config.parallel.tp > 1:
        raise ConfigError("metrics.comm", True, "with train.compile = true and parallel.tp ="
                          f" {config.parallel.tp} > 1: tensor parallelism's collectives are"
                          " counted by a TorchDispatchMode, under which torch.compile runs the"
                          " blocks eagerly; turn one of them off")


def _validate_metrics(config: Config) -> None:
    """The stated MFU peak, the profiled steps and the experiment tracker (whose package must be
    installed: checked here, before launch, rather than by a worker's failed import)."""
    mc, steps = config.metrics, config.train.steps
    if mc.peak_tflops < 0:
        raise ConfigError("metrics.peak_tflops", mc.peak_tflops, "must be >= 0 (0: the catalog's"
                          " peak of a known GPU, else MFU is n/a)")
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
    if tr.recompute_every < 1:
        raise ConfigError("train.recompute_every", tr.recompute_every, "must be >= 1")
    if tr.memory_limit_gb < 0:
        raise ConfigError("train.memory_limit_gb", tr.memory_limit_gb,
                          "must be >= 0 (0: the device's memory, or no check on CPU)")
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
    # ep > 1 composes: dense weights shard over dp_shard x ep, experts over dp_shard (MoE rules
    # in _validate_zero_experts).
    if par.pp > 1:
        _validate_zero_pipeline(config)


def _validate_post_validation(config: Config) -> None:
    """The post-validated optimizer step needs the global gradient norm to be one reduction
    over pp (or none): TP, EP and ZeRO sum their squares over other or chained groups."""
    par = config.parallel
    if not config.train.post_validation:
        return
    for axis, why in (("tp", "the norm sums shards over tp, then over pp"),
                      ("ep", "the norm sums expert shards over ep"),
                      ("dp_shard", "ZeRO's norm sums slices over dp_shard")):
        if getattr(par, axis) > 1:
            raise ConfigError("train.post_validation", True,
                              f"not implemented with {axis} > 1 ({why}); use"
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
    inside a replica (dp_shard and cp; never dp_replicate)."""
    par = config.parallel
    if par.outer_steps < 1:
        raise ConfigError("parallel.outer_steps", par.outer_steps,
                          "must be >= 1 (H: inner optimizer steps per outer step)")
    if not par.outer_lr > 0:
        raise ConfigError("parallel.outer_lr", par.outer_lr, "must be > 0")
    if not 0 <= par.outer_momentum < 1:
        raise ConfigError("parallel.outer_momentum", par.outer_momentum, "must be in [0, 1)")
    if par.outer_fragments < 1:
        raise ConfigError("parallel.outer_fragments", par.outer_fragments,
                          "must be >= 1 (1: the whole model at once)")
    for key in ("co2_gap_penalty", "co2_clip"):
        if getattr(par, key) < 0:
            raise ConfigError(f"parallel.{key}", getattr(par, key), "must be >= 0 (0: off)")
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
    # Not built yet, and why: expert gradients are reduced over groups spanning dp_replicate
    # (dp_no_ep, dp_shard x ep) that have no replica-local version in the mesh yet.
    if par.ep > 1:
        raise ConfigError("parallel.ep", par.ep,
                          f"expert parallelism with dp_mode = {par.dp_mode} is not built yet"
                          " (the expert gradient groups span dp_replicate); use ep = 1 or"
                          " dp_mode = sync")
    # ZeRO-1/2 keep the whole model on every dp_shard rank and average their gradient slices
    # over dp_replicate themselves: the outer loop would need each rank's owned slices only
    # (else it sends dp_shard times the bytes), which is not built.
    if par.dp_shard > 1 and par.zero_stage in (1, 2):
        raise ConfigError("parallel.zero_stage", par.zero_stage,
                          f"ZeRO-{par.zero_stage} with dp_mode = {par.dp_mode} is not built yet"
                          " (its sharded optimizer averages over dp_replicate, and every"
                          " dp_shard rank would send its replica's whole model); use"
                          " zero_stage = 3 or dp_shard = 1")


def _validate_compression(config: Config) -> None:
    """Gradient compression (``parallel.grad_compression``, ``loom.parallel.compression``): its
    knobs are checked whatever the mode; it is a step of the plain data-parallel reducer's
    all-reduce, so it is refused where gradients take another path."""
    par, tr = config.parallel, config.train
    if par.compression_rank < 1:
        raise ConfigError("parallel.compression_rank", par.compression_rank,
                          "must be >= 1 (PowerSGD's rank)")
    if not 0 < par.compression_topk_ratio <= 1:
        raise ConfigError("parallel.compression_topk_ratio", par.compression_topk_ratio,
                          "must be in (0, 1] (the fraction of each tensor's elements sent)")
    if par.compression_refresh < 1:
        raise ConfigError("parallel.compression_refresh", par.compression_refresh,
                          "must be >= 1 (steps between L-GreCo's choices)")
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
    if par.ep > 1:
        # Not built yet: expert gradients take expert parallelism's own reduction
        # (expert.reduce_gradients), which compression does not plug into, so only the dense
        # half of the model would be compressed, and that combination is untested.
        raise ConfigError("parallel.grad_compression", par.grad_compression,
                          f"is not built with expert parallelism (ep = {par.ep}): expert"
                          " gradients take their own reduction; use ep = 1 or"
                          " grad_compression = none")
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
    par, tr = config.parallel, config.train
    if tr.dtype != "bf16":
        return
    unbuilt = [  # (refused when, the combination, why, the other way out)
        (par.dp_mode != "sync", f"parallel.dp_mode = {par.dp_mode}",
         "the outer loop merges the parameters, not their fp32 masters", "dp_mode = sync"),
        (par.grad_compression != "none", f"parallel.grad_compression = {par.grad_compression}",
         "the compressor reads bf16 gradients, not their fp32 accumulation",
         "grad_compression = none"),
        (par.ep > 1, f"expert parallelism (ep = {par.ep})",
         "expert gradients take their own reduction", "ep = 1"),
        (tr.offload_optimizer, "train.offload_optimizer",
         "the fp32 master slices stay on the device", "offload_optimizer = false"),
        (tr.post_validation, "train.post_validation", "untested rollback of fp32 masters",
         "post_validation = false"),
    ]
    for refused, combination, why, other in unbuilt:
        if refused:
            raise ConfigError("train.dtype", tr.dtype,
                              f"bf16 parameters with {combination} are not built ({why}); use"
                              f" train.dtype = bf16_autocast (fp32 parameters) or {other}")


def _validate_zero_pipeline(config: Config) -> None:
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


def _validate_experts(config: Config) -> None:
    """MoE shape rules, and what expert parallelism composes with in this version."""
    m, par = config.model, config.parallel
    if m.n_experts < 0:
        raise ConfigError("model.n_experts", m.n_experts, "must be >= 0 (0: a dense model)")
    if m.n_experts == 0:
        if par.ep > 1:
            raise ConfigError("parallel.ep", par.ep, "expert parallelism needs an MoE model"
                              " (model.n_experts > 0); for data parallelism use dp_replicate")
        return
    if not 1 <= m.top_k <= m.n_experts:
        raise ConfigError("model.top_k", m.top_k, f"must be in [1, model.n_experts = {m.n_experts}]")
    for key in ("expert_ffn_dim", "n_shared_experts", "n_dense_layers"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}", getattr(m, key), "must be >= 0")
    if m.capacity_factor < 0 or m.aux_loss_coef < 0:
        key = "capacity_factor" if m.capacity_factor < 0 else "aux_loss_coef"
        raise ConfigError(f"model.{key}", getattr(m, key), "must be >= 0")
    if m.moe_every < 1:
        raise ConfigError("model.moe_every", m.moe_every, "must be >= 1")
    if not any(m.moe_layer(i) for i in range(m.n_layers)):
        raise ConfigError("model.n_dense_layers", m.n_dense_layers, "leaves no MoE layer"
                          f" (n_layers = {m.n_layers}, moe_every = {m.moe_every})")
    _require_divisible("model.n_experts", m.n_experts, par.ep,
                       "parallel.ep (each ep rank holds n_experts / ep experts)")
    hidden = m.expert_ffn_dim or m.ffn_dim
    if hidden % par.tp:
        raise ConfigError("model.expert_ffn_dim" if m.expert_ffn_dim else "model.ffn_dim", hidden,
                          f"must be divisible by parallel.tp = {par.tp} (expert-TP = TP splits"
                          f" every expert's hidden dim); nearest valid:"
                          f" {_nearest_multiples(hidden, par.tp)}")
    if par.cp > 1 and m.capacity_factor > 0:
        raise ConfigError("model.capacity_factor", m.capacity_factor, f"must be 0 (dropless)"
                          f" with parallel.cp = {par.cp}: capacity is per sequence, and a queue"
                          " position depends on the order of all of a sequence's tokens, which"
                          " cp splits over ranks")
    if par.dp_shard > 1:
        _validate_zero_experts(config)


def _validate_zero_experts(config: Config) -> None:
    """ZeRO (dp_shard > 1) with an MoE model: with ep = 1 experts are ordinary parameters; with
    ep > 1 dense weights shard over dp_shard x ep (x cp) and experts over dp_shard (x cp) (parity
    tests: tests/dist/test_zero_expert.py, with dp_replicate, tp, cp and pp). What is not built
    is refused by name."""
    par = config.parallel
    if par.ep == 1:
        return


def _validate_context_parallel(config: Config) -> None:
    """cp rules: the zig-zag ring needs seq_len divisible by 2*cp (cp for Ulysses alone); the
    Ulysses degree must divide cp and the heads each tp rank holds."""
    par, m = config.parallel, config.model
    if par.cp_ulysses < 0:
        raise ConfigError("parallel.cp_ulysses", par.cp_ulysses, "must be >= 0 (0: automatic)")
    if par.cp == 1:
        return

    if par.cp_mode == "hybrid" and par.cp_ulysses and par.cp % par.cp_ulysses:
        raise ConfigError("parallel.cp_ulysses", par.cp_ulysses,
                          f"must divide parallel.cp = {par.cp}")
    layout = CPLayout.from_mode(par.cp_mode, par.cp, par.cp_ulysses)
    if m.sliding_window and layout.ring > 1:
        raise ConfigError("model.sliding_window", m.sliding_window,
                          f"sliding-window attention under ring attention (parallel.cp ="
                          f" {par.cp}, cp_mode = {par.cp_mode}, ring degree {layout.ring}) is not"
                          " implemented: the ring's blocks would attend past the window; use"
                          " parallel.cp_mode = \"ulysses\" (exact) or cp = 1")
    try:
        check_layout(layout, config.data.seq_len, m.n_heads // par.tp, m.n_kv_heads // par.tp)
    except ValueError as err:
        field = "data.seq_len" if "seq_len" in str(err) else "parallel.cp"
        value = config.data.seq_len if field == "data.seq_len" else par.cp
        raise ConfigError(field, value, f"{err} (parallel.cp_mode={par.cp_mode})") from None


def _validate_tied_pipeline(config: Config, schedule) -> None:
    """Tied embeddings across pipeline stages (loom.pipeline.runtime.tie_embedding): what has a
    parity test runs; the rest is refused by name."""
    par, m = config.parallel, config.model
    if m.n_experts > 0:
        raise ConfigError("model.tie_embeddings", True, "tied embeddings in an MoE pipeline"
                          " (pp > 1, n_experts > 0) are not tested yet; use pp = 1 or untie")
    if par.dp_shard > 1 and par.zero_stage < 3:
        raise ConfigError("parallel.zero_stage", par.zero_stage, "tied embeddings across pipeline"
                          " stages with ZeRO-1/2 are not implemented yet (the tie sum would miss"
                          " the reduced gradient slices the optimizer steps); use zero_stage = 3"
                          " or dp_replicate")
    if par.cp > 1:
        raise ConfigError("parallel.cp", par.cp, "tied embeddings across pipeline stages with"
                          " cp > 1 are not tested yet; use cp = 1 or untie")
    last = schedule.stages_per_route - 1  # of route 0 (each route of bidirectional_v alike)
    if par.dp_shard > 1 and schedule.rank_of(0) == schedule.rank_of(last):
        raise ConfigError("parallel.dp_shard", par.dp_shard,
                          f"schedule {par.schedule!r} puts the first and last stage on one rank,"
                          " where a tied embedding is one Parameter shared by two stages, and"
                          " ZeRO-3 cannot shard it in both; use dp_replicate or a looped"
                          " schedule (1f1b, interleaved_1f1b, zb_h1 ...)")


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
    if par.dp_shard > 1 and par.zero_stage in (1, 2):
        raise ConfigError("parallel.zero_stage", par.zero_stage, f"schedule {par.schedule!r} (two"
                          " model copies, gradients summed over mirror ranks) with ZeRO-1/2 is"
                          " not implemented: their reduced gradients live in flat slices, which"
                          " the copy sum and the norm's count of replicas do not see; use"
                          " zero_stage = 3 (reshard_after_forward = false) or dp_replicate")


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


def _validate_schedule(config: Config) -> None:
    """The pipeline rules: a known schedule family, chunks it accepts, a layer per stage and a
    microbatch count m = global_batch_size / (dp * micro_batch_size) (varlen: in tokens) the
    family can schedule."""
    par, m = config.parallel, config.model
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
    if schedule.num_routes > 1:
        _validate_routes(config, schedule, how)
    if m.tie_embeddings:
        _validate_tied_pipeline(config, schedule)
    splits_backward = any(a.op.name in ("I", "W") for row in schedule.actions for a in row)
    if par.tp > 1 and par.sequence_parallel and splits_backward:
        # Measured: gradients then differ from one process by ~4e-5 (relative), not rounding.
        raise ConfigError("parallel.sequence_parallel", True,
                          f"sequence parallelism inside a pipeline whose schedule splits the"
                          f" backward into I and W ({par.schedule}) is not exact yet; use a"
                          " schedule with full backwards (1f1b, gpipe, interleaved_1f1b,"
                          " looped_bfs) or parallel.sequence_parallel=false")


# --------------------------------------------------------------------------------------------
# Output
