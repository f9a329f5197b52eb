"""Loom's configuration: typed nested dataclasses, read from TOML plus ``--section.key=value``.

Resolution order: dataclass defaults < the model preset named by ``model.preset`` < the TOML file
< command-line overrides. ``load_config`` parses and type-checks every value (unknown keys are
refused with a "did you mean"), then ``validate`` checks every cross-field rule (world size equals
the product of the parallel degrees; heads, KV heads, layers, vocabulary and batch divisible by the
degrees that split them; ...). Both raise ``ConfigError`` naming the field, the value and the rule,
before any process starts or any file is written; the CLI turns that into exit code 2.

The config is plain data: ``to_dict`` / ``to_toml`` write the resolved config next to each run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from loom.config_rules import DEFAULT_SCHEDULE, check_bpe_vocab, validate, validate_model_shape
from loom.data.tokenizer import tokenizer_vocab_size
from loom.data.budgets import token_budgets
from loom.errors import (ConfigError, InputFileError, finite_float, is_int64, loads_toml,
                         read_input_text, suggest)
from loom.layout import CompressionSpec, Job, Layout
from loom.models.hf_config import HFConversionError
from loom.models.args import TransformerArgs
from loom.models.presets import PRESETS

from loom.topology import AXES  # noqa: E402  (one list of axis names)


@dataclass
class ModelConfig(TransformerArgs):
    """The model shape: a preset, then any field overridden. ``vocab_size=0`` means: the
    tokenizer's vocabulary rounded up to a multiple of ``vocab_multiple`` (so it splits evenly)."""

    preset: str = "tiny"  # named shape (loom/models/presets.py); the fields below override it
    vocab_size: int = 0  # 0: the tokenizer's vocabulary rounded up to vocab_multiple
    vocab_multiple: int = 64  # vocab_size = 0 rounds the tokenizer's vocabulary up to this
    # Start from these pretrained weights (a fresh run; a resumed one continues its checkpoint):
    # a Hugging Face model directory (config.json + safetensors) or a Loom run directory. Its
    # model shape replaces the preset; a --model.* override that contradicts it is refused.
    init_from: str = ""


def model_args(config: Config) -> TransformerArgs:
    """The model shape of a resolved config (drops the config-only fields)."""
    fields = {f.name for f in dataclasses.fields(TransformerArgs)}
    return TransformerArgs(**{k: v for k, v in dataclasses.asdict(config.model).items()
                              if k in fields})


@dataclass
class ParallelConfig:
    """Degrees of each mesh axis (see ``loom.topology``); their product is the world size.

    ``ep`` multiplies the world like the others: dense layers treat it as one more data-parallel
    axis, expert layers shard their experts along it.
    """

    pp: int = 1  # pipeline stages (the layers split into pp consecutive parts)
    # data-parallel replicas (each holds whole parameters); -1: whatever the other degrees leave
    # of the world size
    dp_replicate: int = -1
    dp_shard: int = 1  # data-parallel ranks that shard parameters, gradients, optimizer (ZeRO)
    ep: int = 1  # expert parallelism: MoE experts split over ep ranks (data parallel elsewhere)
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    tp: int = 1  # tensor parallelism: heads and MLP columns/rows split over tp ranks
    # Pipeline schedule family (``loom schedule list``) and stages per rank; 0: the family's own
    # (1 for 1F1B-like families, 2 for interleaved/V-shaped ones). Used when pp > 1 (with pp = 1
    # another family than the default is refused: there is no pipeline to schedule).
    schedule: str = DEFAULT_SCHEDULE
    chunks: int = 0
    # schedule = "search": Loom's schedule search (``loom schedule search``) picks the order and
    # the placement, under this activation-memory limit in units of one stage's activations for
    # one microbatch (0: pp, what 1F1B needs), for these relative per-stage costs F,I,W,latency.
    schedule_memory_limit: float = 0.0
    schedule_costs: str = "1,1,1,0"
    # ... and in this placement: "auto" (the search's choice; one stage per rank when the model
    # has fewer than 2 pp layers), "looped", "interleaved" (two looped chunks) or "v"
    schedule_placement: str = "auto"
    # PipeOffload (issue 22): offload saved activations to host memory inside the schedule so
    # that no pipeline rank holds more than this many activation units on its device (units of
    # one full rank's activations of one microbatch; >= 2: one F computing, one copy in flight);
    # 0: off. ``loom.schedule.offload.insert_offload`` places the offloads and reloads.
    schedule_offload_limit: float = 0.0
    # schedule = "skippipe" (SkipPipe, issue 18): each microbatch skips this fraction of the pp
    # stages (never the first or last; skip_ratio * pp a whole number <= pp - 3), on paths the
    # path scheduler chooses over stage_replicas replicas of every stage, which must equal
    # dp_replicate (the world is pp x stage_replicas ranks, one stage replica each)
    skip_ratio: float = 0.0
    stage_replicas: int = 1
    # Tensor parallelism (tp > 1): Megatron sequence parallelism for norms and residuals, and the
    # vocabulary-parallel embedding / head / fused cross entropy.
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    # Vocabulary parallelism across the pipeline (pp > 1; Yeung et al. 2024): the embedding and
    # the output layer with its loss split over the vocabulary onto every pp rank instead of the
    # first and last stage, their passes placed in the schedule (loom.schedule.vocab_passes)
    vocab_parallel_pp: bool = False
    # Context parallelism (cp > 1): "ring" (zig-zag ring attention), "ulysses" (all-to-all to
    # heads), "hybrid" (Ulysses inside groups of cp_ulysses ranks, ring across; 0 = auto) or
    # "allgather" (the ring's zig-zag shards, keys and values all-gathered at once: Megatron's
    # cp_comm_type all_gather, Llama 3's).
    cp_mode: Literal["ring", "ulysses", "hybrid", "allgather"] = "ring"
    cp_ulysses: int = 0
    # Sharded data parallelism on dp_shard (> 1), ZeRO's stages: 1 optimizer state, 2 + gradients
    # (Loom's own sharded optimizer), 3 + parameters (FSDP2). Default 3: a dp_shard axis exists to
    # shard, and stage 3 is the only one whose per-rank model state keeps shrinking with the
    # degree; 1 and 2 trade memory for 2/3 of stage 3's traffic. Moot at dp_shard = 1.
    zero_stage: int = 3
    # Stage 3: free the gathered parameters after forward (and gather again in backward), as in
    # ZeRO-3; false keeps them gathered until backward (stage-2 traffic, more memory).
    reshard_after_forward: bool = True
    # Data parallelism across the dp_replicate replicas (loom/parallel/outer.py): "sync" averages
    # every gradient over every data axis each step; "diloco", "noloco" and "co2" let each
    # replica train on its own part of the batch (gradients averaged only inside it, over
    # dp_shard and cp) and merge the replicas' weights every outer_steps inner steps with an outer
    # SGD step with momentum on the pseudo-gradient (DiLoCo Nesterov, NoLoCo and CO2 heavy
    # ball, as their papers' code): DiLoCo (all-reduce), NoLoCo (one
    # seeded peer, no collective), CO2 (the all-reduce overlapped, applied one outer step late).
    # The final model.safetensors is replica 0's weights.
    dp_mode: Literal["sync", "diloco", "noloco", "co2"] = "sync"
    outer_steps: int = 8  # H: inner optimizer steps per outer step (outer modes)
    outer_lr: float = 0.7  # the outer SGD's learning rate (DiLoCo's; 1 with momentum 0 averages)
    outer_momentum: float = 0.9  # momentum of the outer SGD, in [0, 1)
    # Streaming DiLoCo (dp_mode = diloco): the parameters split into this many contiguous
    # fragments, each merged every outer_steps steps, their merges spread evenly over the window
    # (peak bandwidth / fragments); 1: the whole model at once. At most outer_steps.
    outer_fragments: int = 1
    # dp_mode = co2: weight of the staleness-gap penalty on the one-step-stale update (0: off),
    # and the elementwise bound of the outer momentum (outer momentum clipping; 0: off)
    co2_gap_penalty: float = 1.0
    co2_clip: float = 0.0
    # dp_mode = noloco: the consensus term's weight against the pseudo-gradient's (the authors'
    # code: 1; 0 leaves only the pair's mean pseudo-gradient; loom/parallel/outer.py)
    noloco_consensus: float = 1.0
    # Gradient compression of synchronous data parallelism (loom/parallel/compression.py; plain
    # data parallelism only, not ZeRO or an outer dp_mode): none (the fp32 all-reduce), powersgd
    # (rank compression_rank), int8 (per-chunk scales) or topk (compression_topk_ratio of each
    # tensor), all three with error feedback. compression_adaptive = lgreco re-chooses each
    # tensor's PowerSGD rank or top-k ratio every compression_refresh steps (L-GreCo).
    grad_compression: Literal["none", "powersgd", "int8", "topk"] = "none"
    compression_rank: int = 4  # PowerSGD's rank r (the reference level under lgreco)
    # top-k: the fraction of each tensor's elements sent (the reference level under lgreco)
    compression_topk_ratio: float = 0.01
    # lgreco: per-tensor levels (r/4 ... 4r, or ratio/4 ... 4 ratio) minimizing the bytes within
    # the uniform level's total error; needs grad_compression = powersgd or topk
    compression_adaptive: Literal["none", "lgreco"] = "none"
    compression_refresh: int = 100  # lgreco: steps between re-measuring errors and re-choosing

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def dp(self) -> int:
        """Degree of data parallelism seen by the batch: replicate x shard x expert axes."""
        return self.dp_replicate * self.dp_shard * self.ep


@dataclass
class TrainConfig:
    steps: int = 200  # optimizer steps to train
    global_batch_size: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    # data.packing = varlen: predictions per optimizer step over all ranks, whatever the layout;
    # 0: global_batch_size * data.seq_len (loom/data/varlen.py)
    global_batch_tokens: int = 0
    seed: int = 1234  # seeds the initial weights and the order of the training samples
    device: str = "auto"  # auto (a GPU when there is one) | cpu | cuda | cuda:N ...
    backend: str = "auto"  # auto | gloo | nccl
    # bf16: bf16 parameters in forward and backward, fp32 master weights and Adam moments in the
    # optimizer (sharded at ZeRO-1/2/3), gradients in grad_reduce_dtype; bf16_autocast: fp32
    # parameters, gradients and optimizer, bf16 compute inside autocast
    dtype: Literal["fp32", "bf16", "bf16_autocast"] = "fp32"
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 50  # steps between evaluations on the validation split; 0 disables
    eval_batches: int = 4  # global batches of the validation split per evaluation
    run_dir: str = ""  # where the run's files go; empty: runs/<timestamp>
    threads: int = 0  # intra-op threads per rank; 0: cores / local ranks
    timeout_s: float = 600.0  # collective timeout: a hung peer fails the job instead of hanging it
    # SIGTERM (preemption): every rank stops after the current step, checkpoints and exits 0
    # within this many seconds of the launcher's SIGTERM; past it the launcher kills the workers.
    preempt_grace_s: float = 60.0
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or grad norm: stop, or skip the step
    # nonfinite = skip: stop the run once more than this many steps were skipped (0: stop at the
    # first non-finite step, as "stop" does, but counted and named as a skip)
    max_skipped_steps: int = 10
    # Step the optimizer before the global grad norm / non-finite check arrives, roll back if it
    # says so (loom/train/post_validation.py); bit-identical either way. Not with ZeRO-1/2.
    post_validation: bool = False
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # dtype of the gradient reduction
    # Gradient buckets of plain data parallelism and ZeRO-1/2, in MiB of gradients: a bucket is
    # reduced as soon as its gradients are ready; under ZeRO-2 at most three are held packed.
    grad_bucket_mb: float = 25.0
    # ZeRO-2/3 with gradient accumulation: reduce-scatter after every microbatch's backward and
    # sum the slices (DeepSpeed's ZeRO-2, FSDP2's default) instead of accumulating full-size
    # gradients until the last one: gradients stay 1/d of the model, for m x the reduce-scatters.
    grad_reduce_every_microbatch: bool = False
    # Activation recomputation (loom/parallel/activation.py): none, full (every block), selective
    # (the attention core only), every_k (full recomputation of every recompute_every-th block).
    recompute: Literal["none", "full", "selective", "every_k"] = "none"
    recompute_every: int = 2
    offload_activations: bool = False  # saved activations to host memory (no-op on CPU devices)
    offload_optimizer: bool = False  # optimizer state and step on the host (no-op on CPU devices)
    # torch.compile each transformer block (inductor; loom/parallel/compile.py), after tensor
    # parallelism and recomputation and before ZeRO-3, as TorchTitan does; CPU too. The first
    # steps pay for compilation (seconds per distinct block shape); the numbers equal eager's up
    # to float reordering by the fused kernels.
    compile: bool = False
    # FP8 matmuls in the transformer blocks' linear layers (loom/parallel/fp8.py, torchao's
    # float8 training; the optional extra loom[fp8]): none | tensorwise | rowwise |
    # rowwise_with_gw_hp. Needs a GPU with FP8 (compute capability >= 8.9), or fp8_emulate.
    fp8: str = "none"
    fp8_emulate: bool = False  # torchao's high-precision emulation of the FP8 matmuls (tests)
    # ZeRO-3 (FSDP2) all-gathers the FP8 linears' weights in float8 (1 byte/element, half of
    # bf16's), each shard cast with the whole weight's scale. tensorwise only; dp_shard > 1.
    fp8_all_gather: bool = False
    # Refuse to launch when the estimated peak per rank (loom estimate-memory) exceeds this;
    # 0: the CUDA device's total memory, or on CPU 90% of the host's available memory shared by
    # the local ranks. skip_memory_check (or its older name ignore_memory_limit) overrides.
    memory_limit_gb: float = 0.0
    skip_memory_check: bool = False
    ignore_memory_limit: bool = False  # synonym of skip_memory_check


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate (AdamW), reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warmup to lr over this many steps, then cosine decay
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only (not norms)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon


@dataclass
class DataConfig:
    # "stdlib" (the Python standard library's .py files), a text file or directory, a .jsonl /
    # .parquet / .arrow file (or a directory of them), a `datasets` save_to_disk directory, or a
    # `loom data prepare` directory (loom/data/sources.py)
    source: str = "stdlib"
    extensions: tuple[str, ...] = (".py", ".txt", ".md")  # files read from a source directory
    # "byte" (256 + specials), "bpe" (trained locally), or the path of a Hugging Face
    # tokenizer.json or of a directory holding one (loom/data/hf_tokenizer.py)
    tokenizer: str = "byte"
    bpe_vocab_size: int = 2048  # vocabulary of the BPE tokenizer (tokenizer = bpe)
    seq_len: int = 256  # tokens per training sequence
    val_fraction: float = 0.05  # share of the documents held out for evaluation
    # read at most this many bytes of the corpus (of each data.mix source; a prepared source is
    # used whole); 0: the whole corpus
    max_bytes: int = 0
    text_field: str = "text"  # the column holding the text in a dataset source
    # "path_a:0.7,path_b:0.3": these sources mixed by weight, in place of data.source
    # (loom/data/mix.py)
    mix: str = ""
    # "concat": rows cut from the token stream, attention across documents; "pack": rows of
    # whole documents (long ones split), padded, attention never crossing a document and
    # positions restarting at each (loom/data/packing.py)
    # "varlen": microbatches of whole documents up to a token budget, no padding, no rows
    # (loom/data/varlen.py)
    packing: Literal["concat", "pack", "varlen"] = "concat"
    # varlen: the most predictions in one microbatch (documents are cut into pieces of at most
    # seq_len); 0: train.micro_batch_size * seq_len
    tokens_per_microbatch: int = 0
    # varlen: "none" (microbatches filled in sampling order) or "tokens" (the step's documents,
    # longest first, dealt so every microbatch and rank gets nearly equal tokens) or "zeppelin"
    # (tokens' microbatches, each placed over the dp x cp ranks by loom/data/zeppelin.py, or
    # over the cp ranks at dp = 1, cp > 1)
    balance: Literal["none", "tokens", "zeppelin"] = "none"
    # zeppelin: run the linear modules on an equal split of each microbatch's tokens, moved to
    # the placement's attention layout and back inside every attention layer by all-to-alls
    # (loom/parallel/remap.py via loom/parallel/zeppelin_cp.py); off: a rank's own tokens
    zeppelin_remap: bool = False


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between checkpoints (and one at the end); 0: only the final weights
    keep: int = 2  # newest complete checkpoints kept; 0 keeps all
    # "" (fresh), "auto" (newest complete and valid one of this run; none: refuse),
    # "auto_or_fresh" (the same; none: start fresh) or a checkpoint dir
    resume: str = ""
    # Stage the tensors to CPU memory and write them in the background (DCP async_save); the
    # commit marker still follows the finished write. The run waits for the last save at exit.
    async_save: bool = False


@dataclass
class MetricsConfig:
    log_every: int = 1  # steps between plain progress lines (a terminal's bar shows every step)
    jsonl: bool = True  # run_dir/metrics.jsonl: one JSON object per step and evaluation
    tensorboard: bool = True  # run_dir/tb/: TensorBoard event files
    progress: bool = True  # progress bar on a terminal, plain lines otherwise, with an ETA
    plot: bool = True  # run_dir/loss_curve.png at the end
    comm: bool = False  # count every collective per axis and op and log it each step
    # Peak dense TFLOP/s of one device, which MFU is reported against; 0: the catalog's BF16 peak
    # of a known GPU under train.dtype = bf16, otherwise MFU is n/a (no stated peak, e.g. a CPU)
    peak_tflops: float = 0.0
    # Steps to trace with torch.profiler, "A,B": steps A to B inclusive (one number: that step);
    # every rank writes a Chrome trace to run_dir/profile/rank<r>.json. Empty: no profiling.
    profile_steps: tuple[int, ...] = ()
    # Weights & Biases: rank 0 logs the scalars TensorBoard gets, as a run named after the run
    # directory (needs `pip install loom[wandb]`; WANDB_MODE=offline keeps it under run_dir/wandb)
    wandb: bool = False
    wandb_project: str = "loom"  # the W&B project of metrics.wandb


@dataclass
class FaultConfig:
    # What happens when a worker dies: "checkpoint" (restart every worker from the newest
    # checkpoint, --max-restarts), "checkfree" (only a lost middle pipeline stage's process is
    # replaced, its weights the neighbours' average; no checkpoint: loom/train/checkfree.py) or
    # "checkfree_plus" (CheckFree+: out-of-order microbatches and (de)embedding copies on the
    # neighbours also recover the first and last stage; loom/pipeline/out_of_order.py, pp >= 4)
    recovery: Literal["checkpoint", "checkfree", "checkfree_plus"] = "checkpoint"
    # The rebuilt stage trains on with this multiple of the schedule's learning rate (the
    # authors' code: 1.1, or 1.2 for their 500M model); 1 keeps the schedule's
    recovery_lr_scale: float = 1.1
    # For tests and benchmarks only: SIGKILL the process of this pipeline stage at the start of
    # step test_kill_step (-1: never), once per recovery generation up to test_kill_count times
    test_kill_stage: int = -1
    test_kill_step: int = 0
    test_kill_count: int = 1  # how many kills in all; each next one test_kill_step steps later
    # Instead of test_kill_stage and test_kill_count: the stage killed in each generation, in
    # order (e.g. 0,3: the first stage at test_kill_step, the last at 2 * test_kill_step)
    test_kill_stages: tuple[int, ...] = ()
    # Instead of test_kill_step: the step at whose start each generation's kill lands, one per
    # entry of test_kill_stages, increasing (e.g. 7,31 with stages 1,2: irregular failures)
    test_kill_steps: tuple[int, ...] = ()
    # For tests: write the neighbours' sent blocks and the rebuilt stage to run_dir/checkfree/
    dump_recovery: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)


# --------------------------------------------------------------------------------------------
# Parsing


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def known_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    """Convert ``raw`` (TOML value or command-line string) to ``kind`` or raise ConfigError."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if raw not in choices:
            raise ConfigError(key, raw, f"must be one of {', '.join(map(str, choices))}"
                              + suggest(str(raw), [str(c) for c in choices]))
        return raw
    if origin is tuple or kind is tuple:
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)):
            raise ConfigError(key, raw, "must be a list (TOML array or comma-separated)")
        if typing.get_args(kind)[:1] == (int,):  # tuple[int, ...]: every item an integer
            if any(isinstance(item, (bool, float)) for item in items):
                raise ConfigError(key, raw, "must be a list of integers")
            try:
                return tuple(int(str(item).strip()) for item in items if str(item).strip())
            except ValueError:
                raise ConfigError(key, raw, "must be a list of integers") from None
        return tuple(str(item).strip() for item in items if str(item).strip())
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return raw.lower() in ("true", "1", "yes", "on")
        raise ConfigError(key, raw, "must be a boolean (true or false)")
    if kind is int:
        if isinstance(raw, bool):
            raise ConfigError(key, raw, "must be an integer")
        try:
            value = int(raw) if isinstance(raw, (int, str)) else None
        except ValueError:
            value = None
        if value is None:
            raise ConfigError(key, raw, "must be an integer")
        if not is_int64(value):
            raise ConfigError(key, raw, "must be a 64-bit integer (|value| < 2**63)")
        return value
    if kind is float:
        try:
            if isinstance(raw, bool):
                raise ValueError
            number = finite_float(raw)
        except (TypeError, ValueError):
            raise ConfigError(key, raw, "must be a number") from None
        if number is None:
            raise ConfigError(key, raw, "must be a finite number")
        return number
    if kind is str:
        if not isinstance(raw, str):
            raise ConfigError(key, raw, "must be a string")
        return raw
    raise TypeError(f"unsupported config field type {kind} for {key}")  # a bug in Config itself


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """``["--train.steps=5", "--model.dim", "64"]`` -> ``{"train.steps": "5", "model.dim": "64"}``."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(arg, arg, "expected --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = arg[2:], argv[i + 1]
            i += 1
        else:
            raise ConfigError(arg[2:], None, "has no value; write --section.key=value")
        overrides[key] = value
        i += 1
    return overrides


def _flatten_toml(table: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, body in table.items():
        if not isinstance(body, dict):
            raise ConfigError(section, body, "top-level keys must be sections like [train]"
                              + suggest(section, list(_sections())))
        for key, value in body.items():
            flat[f"{section}.{key}"] = value
    return flat


def _read_toml(path: Path) -> dict[str, Any]:
    """The table of a TOML config file; ConfigError naming ``--config`` when it cannot be one
    (missing, a directory or other non-file, over 64 MiB, unreadable, not UTF-8, not TOML)."""
    try:
        text = read_input_text(path)
    except InputFileError as err:
        rule = err.rule + ("; TOML files are UTF-8" if err.rule.startswith("is not UTF-8") else "")
        raise ConfigError("--config", str(path), rule) from None
    try:
        return loads_toml(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("--config", str(path), f"is not valid TOML: {err}") from None


@functools.cache
def _field_types(section: type) -> dict[str, Any]:
    """A section's field types, resolved once. ``typing.get_type_hints`` evaluates every
    annotation of the class on each call (this module's are strings), and asking it once per key
    made every config built from a table cost 62 ms (140 keys): paid by each trainer, each rank
    and each parity test."""
    return typing.get_type_hints(section)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                pretrained: bool = True) -> Config:
    """Build a Config from an optional TOML file and ``section.key -> value`` overrides.

    Every value is type-checked and every key must exist. Cross-field rules are *not* checked here
    (see ``validate``) so that callers can adjust e.g. the world size first. With
    ``model.init_from`` the model shape is read from that model (``pretrained``; False for a
    run's own resolved config, which already holds it: the run stays readable without it).
    """
    flat: dict[str, Any] = {}
    if path is not None:
        flat.update(_flatten_toml(_read_toml(Path(path))))
    flat.update(overrides or {})

    sections = _sections()
    for key in flat:
        section, _, name = key.partition(".")
        if section not in sections:
            raise ConfigError(key, flat[key], "unknown section" + suggest(section, list(sections)))
        if name not in {f.name for f in dataclasses.fields(sections[section])}:
            raise ConfigError(key, flat[key], "unknown key" + suggest(key, known_keys()))

    preset_name = flat.get("model.preset", ModelConfig.preset)
    if not isinstance(preset_name, str) or preset_name not in PRESETS:
        raise ConfigError("model.preset", preset_name,
                          f"unknown preset; known: {', '.join(PRESETS)}"
                          + suggest(str(preset_name), list(PRESETS)))
    shape = dataclasses.asdict(PRESETS[preset_name])
    shape["vocab_size"] = 0  # presets' vocab sizes are for planning; local runs size from the tokenizer
    if preset_name not in ("tiny", "debug", "tiny-moe"):
        shape["vocab_size"] = PRESETS[preset_name].vocab_size
    config = Config(model=ModelConfig(preset=preset_name, **shape))

    for key, raw in flat.items():
        section, _, name = key.partition(".")
        target = getattr(config, section)
        setattr(target, name, _coerce(key, raw, _field_types(type(target))[name]))
    if config.model.init_from and pretrained:
        _take_pretrained_shape(config, flat)
    return config


# Model fields that change no weight: a run may set them over a pretrained model's.
PRETRAINED_FREE_FIELDS = frozenset({"max_seq_len", "aux_loss_coef", "capacity_factor"})


def _take_pretrained_shape(config: Config, given: dict[str, Any]) -> None:
    """``model.init_from``: the model shape is the pretrained model's (read from its config, not
    its weights); an explicit ``model.*`` value that contradicts it is refused by name. A Hugging
    Face directory's own tokenizer becomes the default ``data.tokenizer``."""
    path = config.model.init_from
    from loom.models.pretrained import PretrainedError, PretrainedSource  # torch: init_from only
    try:
        source = PretrainedSource.open(path)
    except (PretrainedError, HFConversionError) as err:
        raise ConfigError("model.init_from", path, str(err)) from None
    for name, value in dataclasses.asdict(source.args).items():
        key = f"model.{name}"
        if isinstance(value, list):
            value = tuple(value)
        mine = getattr(config.model, name)
        if key in given and mine != value and name not in PRETRAINED_FREE_FIELDS:
            raise ConfigError(key, mine, f"contradicts model.init_from ({path}), whose {name} is"
                              f" {value!r}: the pretrained weights fix the architecture")
        if key not in given or name not in PRETRAINED_FREE_FIELDS:
            setattr(config.model, name, value)
    if source.kind == "hf" and "data.tokenizer" not in given \
            and (Path(path) / "tokenizer.json").is_file():
        config.data.tokenizer = str(path)


# --------------------------------------------------------------------------------------------
# Cross-field validation


def resolve(config: Config, world_size: int) -> Config:
    """Fill the derived values (``dp_replicate=-1``, ``vocab_size=0``) and ``validate``.

    Returns a new Config; raises ConfigError on the first broken rule.
    """
    if type(world_size) is not int or world_size < 1:
        raise ConfigError("world size", world_size, "must be an integer >= 1 (--nproc, or"
                          " WORLD_SIZE under a launcher)")
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model),
        parallel=dataclasses.replace(config.parallel),
    )
    par = config.parallel
    for axis in AXES:
        degree = getattr(par, axis)
        if degree < 1 and not (axis == "dp_replicate" and degree == -1):
            raise ConfigError(f"parallel.{axis}", degree, "must be >= 1"
                              + (" (or -1 to fill the world)" if axis == "dp_replicate" else ""))
    if par.dp_replicate == -1:
        others = math.prod(getattr(par, a) for a in AXES if a != "dp_replicate")
        if world_size % others:
            raise ConfigError("parallel", par.degrees(),
                              f"world size {world_size} is not divisible by pp*dp_shard*ep*cp*tp"
                              f" = {others}")
        par.dp_replicate = world_size // others
    _fill_vocab(config)
    validate(config, world_size)
    return config


def _fill_vocab(config: Config) -> None:
    """``model.vocab_size = 0``: the tokenizer's vocabulary rounded up to ``vocab_multiple``."""
    check_bpe_vocab(config.data)
    if config.model.vocab_size == 0:
        base = tokenizer_vocab_size(config.data.tokenizer, config.data.bpe_vocab_size)
        multiple = config.model.vocab_multiple
        config.model.vocab_size = -(-base // multiple) * multiple


def planned_model(config: Config) -> TransformerArgs:
    """The model a config file describes, for the planner (no world size, no layout): its
    vocabulary filled as ``resolve`` fills it, its shape checked (``validate_model_shape``)."""
    config = dataclasses.replace(config, model=dataclasses.replace(config.model))
    _fill_vocab(config)
    validate_model_shape(config)
    return model_args(config)


def layout_of(config: Config) -> Layout:
    """The ``Layout`` a resolved config trains under, in normal form (``loom.layout``): what
    the trainer, the estimator and the planner all read."""
    par, tr = config.parallel, config.train
    searched = par.pp > 1 and par.schedule == "search"
    chunks = 1 if par.pp == 1 else par.chunks
    if searched:  # the config says the placement; the search's own choice under "auto"
        chunks = {"looped": 1, "interleaved": 2, "v": 2}.get(par.schedule_placement, 0)
    return Layout(
        **par.degrees(),
        zero_stage=par.zero_stage if par.dp_shard > 1 else 0,
        reshard_after_forward=par.reshard_after_forward,
        sequence_parallel=par.sequence_parallel, vocab_parallel=par.vocab_parallel,
        cp_mode=par.cp_mode, cp_ulysses=par.cp_ulysses,
        schedule=par.schedule if par.pp > 1 else "none", chunks=chunks,
        schedule_memory_limit=par.schedule_memory_limit if searched else 0.0,
        schedule_costs=par.schedule_costs if searched else "",
        schedule_placement=par.schedule_placement if searched else "auto",
        schedule_offload_limit=par.schedule_offload_limit if par.pp > 1 else 0.0,
        **_microbatching(config),
        recompute=tr.recompute, recompute_every=tr.recompute_every,
        vocab_parallel_pp=par.vocab_parallel_pp)


def _microbatching(config: Config) -> dict[str, int]:
    """The layout's ``micro_batch`` and ``microbatches``. Varlen (``loom.data.varlen``): the
    step's token budget shared by dp, in microbatches of ``tokens_per_microbatch``, priced as
    the fewest ``seq_len`` rows that hold that many tokens (an upper bound for memory)."""
    par, tr, data = config.parallel, config.train, config.data
    if data.packing != "varlen":
        return {"micro_batch": tr.micro_batch_size,
                "microbatches": tr.global_batch_size // (par.dp * tr.micro_batch_size)}
    step, micro = token_budgets(tr.global_batch_tokens, data.tokens_per_microbatch,
                                tr.global_batch_size, tr.micro_batch_size, data.seq_len)
    return {"micro_batch": -(-micro // data.seq_len), "microbatches": step // (par.dp * micro)}


def job_of(config: Config, offload_optimizer: bool = False) -> Job:
    """What the model and parallelism builders need from a resolved config, as one value;
    ``offload_optimizer`` is the offload plan's answer for this rank's device."""
    tr = config.train
    return Job(args=model_args(config), layout=layout_of(config), seq_len=config.data.seq_len,
               seed=tr.seed, dtype=tr.dtype, grad_reduce_dtype=tr.grad_reduce_dtype,
               grad_bucket_mb=tr.grad_bucket_mb, offload_optimizer=offload_optimizer,
               grad_reduce_every_microbatch=tr.grad_reduce_every_microbatch,
               dp_mode=config.parallel.dp_mode, compile=tr.compile,
               packing=config.data.packing,
               compression=compression_of(config), fp8=tr.fp8, fp8_emulate=tr.fp8_emulate,
               fp8_all_gather=tr.fp8_all_gather,
               vocab_parallel_pp=config.parallel.vocab_parallel_pp)


def compression_of(config: Config) -> CompressionSpec | None:
    """The reducer's gradient compression (``parallel.grad_compression*``); None: none."""
    par = config.parallel
    if par.grad_compression == "none":
        return None
    return CompressionSpec(method=par.grad_compression, rank=par.compression_rank,
                           topk_ratio=par.compression_topk_ratio,
                           adaptive=par.compression_adaptive, refresh=par.compression_refresh)


def with_layout(config: Config, layout: Layout) -> Config:
    """``config`` trained under ``layout``: a new Config whose ``[parallel]`` and the
    microbatching and recomputation of ``[train]`` are the layout's, by value (not resolved:
    pass it to ``resolve``). Knobs the layout leaves at "not set" keep the config's: the ZeRO
    stage at dp_shard = 1, the schedule at pp = 1, the search's costs when empty."""
    par = dataclasses.replace(
        config.parallel, **layout.degrees(),
        reshard_after_forward=layout.reshard_after_forward,
        sequence_parallel=layout.sequence_parallel, vocab_parallel=layout.vocab_parallel,
        cp_mode=layout.cp_mode, cp_ulysses=layout.cp_ulysses,
        vocab_parallel_pp=layout.vocab_parallel_pp,
        schedule_offload_limit=layout.schedule_offload_limit)
    if layout.zero_stage:
        par.zero_stage = layout.zero_stage
    if layout.searched:
        par.schedule, par.chunks = "search", 0
        par.schedule_placement = layout.schedule_placement
        par.schedule_memory_limit = layout.schedule_memory_limit
        if layout.schedule_costs:
            par.schedule_costs = layout.schedule_costs
    elif layout.pp > 1:
        par.schedule, par.chunks = layout.schedule, layout.chunks
    train = dataclasses.replace(
        config.train, global_batch_size=layout.global_batch, micro_batch_size=layout.micro_batch,
        recompute=layout.recompute, recompute_every=layout.recompute_every)
    return dataclasses.replace(config, parallel=par, train=train)


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    out = dataclasses.asdict(config)
    for section in out.values():
        for key, value in section.items():
            if isinstance(value, tuple):
                section[key] = list(value)
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(config: Config) -> str:
    """The resolved config as TOML that ``load_config`` reads back to an equal Config."""
    lines: list[str] = []
    for section, body in to_dict(config).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in body.items())
        lines.append("")
    return "\n".join(lines)


def from_dict(table: dict[str, dict[str, Any]]) -> Config:
    """Inverse of ``to_dict`` (used by workers and ``loom generate``)."""
    return load_config(None, {f"{s}.{k}": v for s, body in table.items() for k, v in body.items()},
                       pretrained=False)


__all__ = ["AXES", "Config", "ConfigError", "load_config", "parse_overrides", "planned_model",
           "resolve", "validate", "to_dict", "to_toml", "from_dict", "layout_of", "with_layout", "job_of"]
