"""The ``loom`` command: ``loom train``, ``generate``, ``schedule ...``, ``hf ...``, ``plan``,
``data prepare``.

``loom train [--config FILE] [--nproc N] [--section.key=value ...]`` loads and validates the whole
configuration *before* anything is written or started: a bad value prints one line naming the
field, the value and the rule, and exits with code 2. That covers the inputs too: the config file,
the corpus (``data.source``), the checkpoint to resume, the run directory (``train.run_dir``) and
the estimated memory against the device's (on CPU: the host's available memory, shared by the
``--nproc`` ranks). A corpus found too short only once tokenized is refused the same way, and the
directories made for it are removed.

Everyday tools of ``loom train`` (each exits without writing anything or starting a worker):
``--print-config`` prints the resolved config as TOML (``--config`` reads it back), ``--dry-run``
runs every check above and prints the per-rank memory estimate and the rank grid, and ``--help``
lists every config key with its default and description (``loom.config_help``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError

from loom.calibration.measure import calibrate
from loom.cluster import Cluster
from loom.cluster import load as load_cluster
from loom.config import Config, ConfigError, load_config, parse_overrides, resolve, to_toml
from loom.config_help import help_text
from loom.data.cli import add_data_commands
from loom.errors import OneLineParser, path_arg
from loom.fp8_support import device_refusal as fp8_device_refusal
from loom.generate import generate, sampling_errors
from loom.grid_summary import describe_grid
from loom.hf_cli import add_hf_commands
from loom.launch import check_run_dir, refuse_checkfree_launch, run_job, under_external_launcher
from loom.pipeline.cli import add_schedule_commands
from loom.plan.cli import add_plan_commands
from loom.topology import RankGrid
from loom.train.checkpoint import resume_refusal
from loom.train.distributed import device_refusal, resolve_device
from loom.train.memory import GiB, check_memory_limit, device_limit_bytes, estimate_memory
from loom.train.resume_checks import resume_state_refusal

EXIT_CONFIG_ERROR = 2


def _launcher_count(name: str, default: int | None) -> int:
    """A count the external launcher sets in the environment (``WORLD_SIZE``...): a whole
    number >= 1, else ConfigError naming the variable (``default`` when it may be unset)."""
    if name not in os.environ and default is not None:
        return default
    return _launcher_number(name, 1, None, required=True)


def _launcher_number(name: str, low: int, high: int | None, what: str = "",
                     required: bool = False) -> int | None:
    """A number the launcher sets (``RANK``...), when set (``required``: also when not): a
    whole number in [low, high] (``high`` None: no upper bound), else ConfigError naming the
    variable (a RANK past WORLD_SIZE would wait for peers that never come; ``int("abc")``
    would be a traceback in every worker). None when unset and not required."""
    raw = os.environ.get(name)
    if raw is None and not required:
        return None
    digits = raw is not None and raw.strip().isascii() and raw.strip().isdigit()
    value = int(raw) if digits else low - 1
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"environment {name}", raw, f"must be a whole number {rule}{what}"
                          " (the launcher sets it)")
    return value


# A job id names the default run directory (runs/<id>): one plain path component
_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def _check_launcher_env(world_size: int, local_ranks: int, names_run_dir: bool) -> None:
    """The rest of what an external launcher sets, checked before anything starts: the ranks
    within the world, the restart count, the rendezvous port and, when it names the default
    run directory (``runs/<TORCHELASTIC_RUN_ID>``), the job id: ``../..`` would leave runs/."""
    _launcher_number("RANK", 0, world_size - 1, f" (WORLD_SIZE = {world_size})")
    _launcher_number("LOCAL_RANK", 0, local_ranks - 1, f" (LOCAL_WORLD_SIZE = {local_ranks})")
    _launcher_number("TORCHELASTIC_RESTART_COUNT", 0, 2**31 - 1)
    _launcher_number("MASTER_PORT", 1, 65535)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if names_run_dir and run_id is not None and not _RUN_ID.fullmatch(run_id):
        raise ConfigError("environment TORCHELASTIC_RUN_ID", run_id[:80], "must be 1-128"
                          " letters, digits, '_', '.' or '-', not starting with '.' or '-', to"
                          " name the default run directory (or set --train.run_dir)")


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        if args.nproc < 1:
            raise ConfigError("--nproc", args.nproc, "must be >= 1")
        if args.max_restarts < 0:
            raise ConfigError("--max-restarts", args.max_restarts, "must be >= 0")
        overrides = parse_overrides(extra)
        if args.resume:
            overrides["checkpoint.resume"] = args.resume
        config = load_config(args.config, overrides)
        external = under_external_launcher()
        world_size = _launcher_count("WORLD_SIZE", None) if external else args.nproc
        local_ranks = _launcher_count("LOCAL_WORLD_SIZE", 1) if external else args.nproc
        if external:
            _check_launcher_env(world_size, local_ranks, not config.train.run_dir)
        config = resolve(config, world_size)
        cluster = _emulated_cluster(args, world_size, external)
        tr = config.train
        refused = device_refusal(tr.device, tr.backend, local_ranks)
        if refused:
            field, rule = refused
            raise ConfigError(field, getattr(tr, field.split(".")[1]), rule)
        # this machine's device (local rank 0's: every rank of a node has the same kind)
        refusal = fp8_device_refusal(tr.fp8, tr.fp8_emulate, resolve_device(tr.device, 0))
        if refusal:
            raise ConfigError("train.fp8", tr.fp8, refusal)
        if tr.fp8 != "none" and not tr.fp8_emulate and not tr.compile:
            # measured on an H100 (docs/benchmarks.md, GPU run 3): 0.62x of eager bf16
            print("loom train: note: train.fp8 without train.compile runs torchao's casts as"
                  " separate kernels, slower than bf16; set train.compile = true",
                  file=sys.stderr)
    except ConfigError as err:
        print(f"loom train: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.print_config:  # before the run directory gets its default: "" stays "a new one"
        print(to_toml(config), end="")
        return 0
    # before anything is written or started; the host's memory is shared by this node's ranks
    refusal = check_memory_limit(config, local_ranks)
    if refusal:
        print(f"loom train: {refusal}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    run_dir = config.train.run_dir
    if not run_dir:
        # Every rank of a multi-node job must agree on the directory: use the job's run id there.
        name = os.environ.get("TORCHELASTIC_RUN_ID") if external else None
        run_dir = f"runs/{name or time.strftime('%Y%m%d-%H%M%S')}"
        config.train.run_dir = run_dir
    try:
        check_run_dir(Path(run_dir))
        if not external:  # under torchrun, rank 0 of the job decides (every rank would hash)
            refusal = resume_refusal(config.checkpoint.resume, Path(run_dir) / "checkpoints",
                                     check=partial(resume_state_refusal, config))
            if refusal:
                print(f"loom train: config error: {refusal}", file=sys.stderr)
                return EXIT_CONFIG_ERROR
        if config.fault.recovery != "checkpoint":  # checked by --dry-run too
            refuse_checkfree_launch(config, args.max_restarts, cluster)
        if args.dry_run:
            print(_dry_run_report(config, Path(run_dir), local_ranks))
            return 0
        # a corpus found too short once tokenized is refused here, its directories removed
        return run_job(config, Path(run_dir), args.nproc, args.max_restarts, cluster)
    except ConfigError as err:
        print(f"loom train: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def _emulated_cluster(args: argparse.Namespace, world_size: int, external: bool) -> Cluster | None:
    """The cluster ``--cluster FILE --emulate`` asks to emulate (checked), or None."""
    if args.cluster is None:
        if args.emulate:
            raise ConfigError("--emulate", True, "needs --cluster FILE: the cluster to emulate")
        return None
    cluster = load_cluster(args.cluster)
    cluster.check_world(world_size, "--cluster")
    if not args.emulate:  # a description alone changes nothing in a real run: say so
        raise ConfigError("--cluster", args.cluster, "is used by loom train only with --emulate"
                                                     " (the planner reads it on its own)")
    if external:
        raise ConfigError("--emulate", True, "runs local workers only, not under torchrun")
    return cluster


def _dry_run_report(config: Config, run_dir: Path, local_ranks: int) -> str:
    """What ``loom train --dry-run`` prints once every check has passed."""
    state = "exists; the run continues in it" if run_dir.exists() else "would be created"
    return "\n".join([
        "loom train --dry-run: every check passed; nothing was written or started",
        f"run dir: {run_dir} ({state})",
        "", "per-rank memory (estimate, the worst pipeline rank):",
        _memory_report(config, local_ranks),
        "", describe_grid(RankGrid(config.parallel.degrees()))])


def _memory_report(config: Config, local_ranks: int) -> str:
    """The layout, the estimator's breakdown and the limit it is held to (``local_ranks``: the
    ranks on this host, which share its memory on CPU)."""
    par = config.parallel
    lines = [f"layout: {par.degrees()} zero_stage={par.zero_stage if par.dp_shard > 1 else '-'}"
             f" recompute={config.train.recompute} dtype={config.train.dtype}"
             f" micro_batch={config.train.micro_batch_size} seq={config.data.seq_len}"]
    estimate = estimate_memory(config)
    lines.append(estimate.table())
    limit = device_limit_bytes(config, local_ranks)
    if limit:
        lines.append(f"limit {limit / GiB:.3f} GiB:"
                     f" {'fits' if estimate.total <= limit else 'EXCEEDS'}")
    return "\n".join(lines)


def _estimate_memory(args: argparse.Namespace, extra: list[str]) -> int:
    """Predicted bytes per rank of a config's layout, before launch (``loom.train.memory``)."""
    try:
        config = resolve(load_config(args.config, parse_overrides(extra)), args.nproc)
    except ConfigError as err:
        print(f"loom estimate-memory: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(_memory_report(config, args.nproc))  # on CPU: the layout's ranks on this host
    return 0


class _TrainHelp(argparse.Action):
    """``loom train --help``: the usage, then every config key with its default and description.
    Built only when asked: reading the keys' comments from the source takes a tenth of a second,
    which every other command would pay."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.epilog = f"{parser.epilog}\n\n{help_text()}"
        parser.print_help()
        parser.exit()


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        print(f"loom generate: unexpected arguments {extra}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or str(device) != "cpu" and (device.type != "cuda" or not (
            torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count())):
        print(f"loom generate: --device {args.device!r} must name a device this machine has"
              " (cpu, cuda, cuda:N)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (kept as surrogates)
        print(f"loom generate: --prompt {ascii(args.prompt)[:80]}: is not UTF-8 text",
              file=sys.stderr)
        return EXIT_CONFIG_ERROR
    for name, value, rule in sampling_errors(args.max_new_tokens, args.temperature,
                                             args.top_k)[:1]:
        print(f"loom generate: --{name.replace('_', '-')} {value}: {rule}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not 0 <= args.seed < 2 ** 63:  # what torch.Generator.manual_seed takes, non-negative
        print(f"loom generate: --seed {args.seed}: must be in [0, 2**63)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        text = generate(Path(args.run), args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                        device=str(device))
    except (OSError, ValueError, ConfigError, SafetensorError) as err:  # the run's files
        reason = (str(err).splitlines() or [repr(err)])[0]
        print(f"loom generate: --run {args.run}: {reason}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="loom", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model on local processes or under torchrun",
                           epilog="Any config field can be set as --section.key=value, e.g."
                                  " --train.steps=50 --parallel.dp_replicate=2.",
                           add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("-h", "--help", action=_TrainHelp,
                       help="show this help, with every config key, its default and what it"
                            " does, and exit")
    train.add_argument("--config", type=path_arg,
                       help="TOML config file (defaults apply for missing keys)")
    train.add_argument("--nproc", type=int, default=1,
                       help="local worker processes to start (ignored under torchrun)")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="restart all workers up to N times when one fails; they resume from"
                            " the newest complete checkpoint (set --checkpoint.interval)")
    train.add_argument("--cluster", type=path_arg,
                       help="a cluster description (TOML, loom/cluster.py): one"
                            " node per rank, each link's latency and bandwidth")
    train.add_argument("--emulate", action="store_true",
                       help="run the local workers on an emulated network of --cluster: one"
                            " network namespace per rank, each link shaped to its bandwidth"
                            " (root; latency is not emulated)")
    train.add_argument("--resume", type=path_arg,
                       help="'auto' (newest complete and valid checkpoint of the run;"
                            " refused when there is none), 'auto_or_fresh' (the"
                            " same, or step 0 when there is none) or a checkpoint"
                            " directory; same as --checkpoint.resume")
    only = train.add_mutually_exclusive_group()
    only.add_argument("--print-config", action="store_true",
                      help="print the resolved config as TOML (--config reads it back) and exit;"
                           " writes nothing")
    only.add_argument("--dry-run", action="store_true",
                      help="run every check of a launch (config, inputs, run directory, memory),"
                           " print the per-rank memory estimate and the rank grid, and exit;"
                           " writes nothing")
    train.set_defaults(handler=_train)

    mem = sub.add_parser("estimate-memory", help="predict per-rank memory of a layout",
                         epilog="Any config field can be set as --section.key=value.")
    mem.add_argument("--config", type=path_arg,
                     help="TOML config file (defaults apply for missing keys)")
    mem.add_argument("--nproc", type=int, default=1, help="world size of the layout")
    mem.set_defaults(handler=_estimate_memory)

    gen = sub.add_parser("generate", help="sample text from a trained run")
    gen.add_argument("--run", type=path_arg, required=True,
                     help="run directory of a finished `loom train`")
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="0: greedy; otherwise in [1e-4, 1e4]")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cpu", help="where to sample: cpu, cuda, cuda:N")
    gen.set_defaults(handler=_generate)

    add_schedule_commands(sub)

    add_hf_commands(sub)

    add_data_commands(sub)

    add_plan_commands(sub, measure_machine=calibrate)  # --calibrate: processes, the trainer
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    return args.handler(args, extra)


if __name__ == "__main__":
    sys.exit(main())
