"""``loom plan``: rank the layouts of a model on a cluster, explain one, write the best as a config.

    loom plan --model llama3-70b --gpus 512 --gpu H100-SXM --gpus-per-node 8 --seq 8192 \\
              --global-batch-tokens 8388608 [--top 5] [--json] [--explain [N]] [-o plan.toml]
    loom plan --model gpt-1t --gpus 3072 --gpu A100-80GB --seq 2048 --global-batch-tokens ... \\
              --layout pp=64,tp=8,dp_replicate=6,schedule=interleaved_1f1b,chunks=2,recompute=full
    loom plan --model llama3-405b --gpus 16384 --seq 8192 --global-batch-tokens 16777216 \\
              --nodes-per-rack 2 --racks-per-pod 192 --spine-oversubscription 7  # Llama 3's RoCE
    loom plan --calibrate [--nproc 4]          # measure this machine; --gpu local then uses it
    loom plan --model llama3-8b --gpus 256 --length-dist lengths.json --global-batch-tokens ...
                                               # balances of variable-length steps (plan.varlen)

Bad input (an unknown model, accelerator or link, a batch that does not divide into sequences,
a layout field that does not exist) is refused with the field and the rule, exit code 2, before
anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from loom.config import ConfigError, load_config, planned_model
from loom.errors import OneLineParser, path_arg
from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.models.hf_config import HFConversionError, args_from_hf_file
from loom.models.presets import PRESETS
from loom.layout import FP8_RECIPES
from loom.plan import explain, varlen
from loom.plan.calibrate import describe, load_profile
from loom.plan.mixed import MixedClusterError, load_mixed, rank_mixed, report
from loom.plan.hardware import (LINKS, MAX_OVERSUBSCRIPTION, Cluster, HardwareError, load_catalog,
                                make_cluster)
from loom.plan.layout_input import LayoutInputError, check_layout_input
from loom.plan.search import Plan, check_vocab_pp, plan, simulate_step
from loom.plan.space import Workload
from loom.sim.cost_model import CostModel, StepCost
from loom.sim.frameworks import ATTENTION_KERNELS, FRAMEWORKS, Framework, framework
from loom.sim.outer_cost import Sites, price_modes, recommend
from loom.sim.varlen_cost import load_length_distribution

EXIT_BAD_INPUT = 2
# far above any cluster (published runs reach 16,384 to ~10^5 accelerators)
MAX_GPUS = 10**7
DEFAULT_GPU = "H100-SXM"  # assumed where neither --gpu nor a --hardware [cluster] names one


class PlanInputError(ValueError):
    """A ``loom plan`` argument breaks a rule; ``str()`` names the argument and the rule."""


# The network's topology (``loom.plan.hardware.Cluster``): flag, type, help. Each overrides the
# ``[cluster]`` key of a ``--hardware`` file with its name (``--nodes-per-rack`` ->
# ``nodes_per_rack``); unset, the file's value or non-blocking.
TOPOLOGY_FLAGS = (
    ("--nodes-per-rack", int, "nodes behind one top-of-rack switch (0: one rack)"),
    ("--rack-oversubscription", float, "a rack's downlink : uplink bandwidth, >= 1 (1:"
                                       " non-blocking; Cluster.uplink_overload prices it)"),
    ("--racks-per-pod", int, "racks behind one spine / aggregation layer (0: one pod);"
                             " needs --nodes-per-rack"),
    ("--spine-oversubscription", float, "a pod's downlink : uplink bandwidth towards the other"
                                        " pods, >= 1 (Llama 3's aggregation layer: 7)"),
)


def _topology(args: argparse.Namespace, defaults: dict) -> dict[str, float]:
    """The topology flags given, checked one by one: a whole number >= 0 for the counts, a
    number >= 1 for the oversubscription ratios; ``--racks-per-pod`` needs a rack size (the
    flag's or the ``--hardware`` file's ``defaults``)."""
    out: dict[str, float] = {}
    for flag, kind, _ in TOPOLOGY_FLAGS:
        key = flag[2:].replace("-", "_")
        raw = getattr(args, key, None)
        if raw is None:
            continue
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if kind is int and (value is None or value < 0):
            raise PlanInputError(f"{flag} {raw}: must be a whole number >= 0 (0: all in one)")
        if kind is float and (value is None or not 1 <= value <= MAX_OVERSUBSCRIPTION):
            raise PlanInputError(f"{flag} {raw}: must be a number in [1,"
                                 f" {MAX_OVERSUBSCRIPTION:g}] (downlink : uplink; 1 is"
                                 " non-blocking)")
        out[key] = value
    if out.get("racks_per_pod") and not out.get("nodes_per_rack",
                                                defaults.get("nodes_per_rack", 0)):
        raise PlanInputError(f"--racks-per-pod {out['racks_per_pod']}: needs --nodes-per-rack"
                             " > 0 (the size of a rack)")
    return out


def add_plan_commands(sub: argparse._SubParsersAction,
                      measure_machine: Callable[[int, str | None], Path] | None = None) -> None:
    """``loom plan``. ``measure_machine(nproc, profile_path)`` runs the calibration for
    ``--calibrate`` and returns the profile's path: the command layer passes it in
    (``loom.calibration.measure.calibrate``, which uses the trainer), so the planner itself only
    reads profiles."""
    plan = sub.add_parser("plan", help="predict and rank parallel layouts for a model on a cluster",
                          description=__doc__.splitlines()[0])
    plan.add_argument("--model", type=path_arg,
                      help="a preset name (loom.models.presets), a Loom TOML config,"
                      " or a Hugging Face model directory or its config.json (Llama, Qwen2/3,"
                      " Mistral; only the config is read; --seq required)")
    plan.add_argument("--gpus", type=int, help="number of accelerators")
    plan.add_argument("--gpu", help="accelerator type from the catalog, or 'local' (the"
                      f" calibrated machine; default: a --hardware file's [cluster] gpu, else"
                      f" {DEFAULT_GPU})")
    plan.add_argument("--gpus-per-node", type=int, default=0, help="0: the accelerator's default")
    plan.add_argument("--intra", help="intra-node link name (default: the accelerator's)")
    plan.add_argument("--inter", help="inter-node link name (default: the accelerator's)")
    plan.add_argument("--hardware", type=path_arg,
                      help="TOML file adding or overriding catalog entries")
    for flag, kind, what in TOPOLOGY_FLAGS:
        plan.add_argument(flag, metavar="N" if kind is int else "R", help=what)
    plan.add_argument("--seq", type=int, help="sequence length (default: the config's)")
    plan.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    plan.add_argument("--top", type=int, default=5)
    plan.add_argument("--json", action="store_true", help="print the ranking as JSON")
    plan.add_argument("--explain", nargs="?", const=1, type=int, metavar="N",
                      help="time and memory breakdown of the N-th ranked layout (default 1)")
    plan.add_argument("--layout", help="price this one layout instead of searching, as"
                                       " field=value pairs of loom.layout.Layout")
    plan.add_argument("-o", "--output", type=path_arg,
                      help="write the chosen layout's Loom config here")
    plan.add_argument("--memory-fraction", type=float, default=0.9,
                      help="share of device memory a layout may plan to use")
    plan.add_argument("--any", action="store_true",
                      help="rank layouts this version of Loom refuses too (for what-if planning)")
    plan.add_argument("--framework", default="loom",
                      help="the stack whose memory layout and overlap to price: "
                           + ", ".join(FRAMEWORKS) + " (default loom; loom.sim.frameworks)")
    plan.add_argument("--attention-kernel", choices=ATTENTION_KERNELS,
                      help="the attention kernel another stack runs (default: its profile's;"
                           " fused/unfused store the s x s scores)")
    plan.add_argument("--norm-kernel", metavar="true|false",
                      help="whether another stack runs each RMSNorm as one kernel (default: its"
                           " profile's; false: eager ops, e.g. Llama's reference norm)")
    plan.add_argument("--calibrate", action="store_true", help="measure this machine and store"
                                                               " the profile --gpu local uses")
    plan.add_argument("--nproc", type=int, default=0, help="processes for --calibrate (and"
                                                           " --gpu local's default --gpus)")
    plan.add_argument("--profile", type=path_arg,
                      help="calibration profile path (default ~/.cache/loom/local.json)")
    plan.add_argument("--fp8", default="none", metavar="RECIPE",
                      help="price the blocks' linears in FP8 (train.fp8: tensorwise, rowwise,"
                           " rowwise_with_gw_hp) at the accelerator's FP8 peak")
    plan.add_argument("--fp8-all-gather", action="store_true",
                      help="ZeRO-3 layouts all-gather the FP8 linears' weights in float8, 1 byte"
                           " per element (train.fp8_all_gather; needs --fp8 tensorwise)")
    plan.add_argument("--compile", metavar="true|false",
                      help="price the blocks compiled (train.compile: element-wise chains fused)"
                           " or eager (default: the --model config's train.compile, else the"
                           " --framework profile's; loom.sim.eager_cost)")
    plan.add_argument("--sites", type=int, default=0,
                      help="price the best layout's data-parallel replicas over this many sites"
                           " under each dp_mode (sync, diloco, noloco, co2) and recommend one")
    plan.add_argument("--site-link", default="wan-1gbit",
                      help="each site's uplink (a catalog link, e.g. wan-100mbit, wan-1gbit)")
    plan.add_argument("--outer-steps", default="8,32,128", metavar="H,H,...",
                      help="the outer modes' inner steps per outer step to price")
    plan.add_argument("--length-dist", type=path_arg, metavar="FILE",
                      help="rank the balances of variable-length steps drawn from this length"
                           " distribution (loom.sim.varlen_cost; loom.plan.varlen)")
    plan.add_argument("--mixed", type=path_arg, metavar="FILE",
                      help="a cluster of unlike accelerators ([[part]] tables: gpu, gpus, links;"
                           " [between] link): rank pipelines whose stages sit on the parts and"
                           " data parallelism across them (loom/plan/mixed.py, mixed_dp.py)")
    plan.add_argument("--nics-per-node", type=int, default=0,
                      help="NICs sharing a node's inter-node bandwidth (0: one per GPU);"
                           " read by --length-dist's routing-layer model only")
    plan.set_defaults(handler=_plan, measure_machine=measure_machine)


def parse_layout(text: str) -> Layout:
    """``pp=8,tp=8,...`` -> Layout, every field checked by name and type."""
    fields = {f.name: f for f in dataclasses.fields(Layout)}
    values: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key not in fields:
            raise PlanInputError(f"--layout {part!r}: expected field=value with field in"
                                 f" {', '.join(fields)}")
        if key in values:
            raise PlanInputError(f"--layout {key}: given twice")
        kind = type(getattr(Layout(), key))
        if kind is bool:
            if raw.lower() not in _BOOLS:
                raise PlanInputError(f"--layout {key}={raw}: must be true or false")
            values[key] = _BOOLS[raw.lower()]
            continue
        try:
            values[key] = kind(raw)
        except ValueError:
            raise PlanInputError(f"--layout {key}={raw}: must be {kind.__name__}") from None
    return Layout(**values)


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _derived_microbatches(layout: Layout, text: str, global_batch: int) -> Layout:
    """``layout`` with its microbatches derived from the workload's global batch (sequences)
    when ``--layout`` leaves them out and dp x micro_batch divides it (``_check_batch`` refuses
    what remains inconsistent)."""
    per_microbatch = layout.dp * layout.micro_batch
    given = any(p.split("=")[0].strip() == "microbatches" for p in text.split(","))
    if given or per_microbatch < 1 or global_batch % per_microbatch:
        return layout
    return dataclasses.replace(layout, microbatches=global_batch // per_microbatch)


def _check_batch(layout: Layout, global_batch: int) -> None:
    """Refuse a ``--layout`` whose dp x micro_batch x microbatches is not the global batch: a
    step of 8 sequences priced against a batch of 128 printed an MFU of 810%."""
    per_microbatch = layout.dp * layout.micro_batch
    if per_microbatch * layout.microbatches == global_batch:
        return
    if global_batch % per_microbatch:
        raise PlanInputError(
            f"--layout micro_batch={layout.micro_batch}: dp {layout.dp} x micro_batch"
            f" {layout.micro_batch} = {per_microbatch} sequences does not divide the global"
            f" batch of {global_batch} (--global-batch-tokens / --seq)")
    raise PlanInputError(
        f"--layout microbatches={layout.microbatches}: dp {layout.dp} x micro_batch"
        f" {layout.micro_batch} x microbatches {layout.microbatches} ="
        f" {per_microbatch * layout.microbatches} sequences, not the global batch of"
        f" {global_batch} (--global-batch-tokens / --seq); leave microbatches out to derive it")


def _hf_config_path(model: str) -> Path | None:
    """The ``config.json`` ``--model`` names: a Hugging Face model directory or the file itself."""
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        return path / "config.json"
    return path if path.suffix.lower() == ".json" and path.exists() else None


def _hf_model(config_json: Path) -> TransformerArgs:
    """The shape of a Hugging Face ``config.json`` (Llama, Qwen2/3, Mistral; anything Loom's
    model does not compute exactly refused by key), held to Loom's model rules. Only the config
    is read, never the weights, and nothing imports torch."""
    try:
        shape = args_from_hf_file(config_json)
    except HFConversionError as err:
        raise PlanInputError(f"--model {config_json}: {err}") from None
    fields = {f"model.{k}": v for k, v in dataclasses.asdict(shape).items()}
    return planned_model(load_config(None, fields))


def _planned(args: argparse.Namespace) -> tuple[TransformerArgs, str, int | None, str | None]:
    """``--model``: a preset, a Loom TOML config, or a Hugging Face model directory / its
    config.json. Returns the shape, a name, the default sequence length (None: --seq is
    required) and the config file to plan for (None: the shape alone)."""
    if args.model in PRESETS:
        return PRESETS[args.model], args.model, PRESETS[args.model].max_seq_len, None
    hf_json = _hf_config_path(args.model)
    if hf_json is not None:
        # max_position_embeddings is a limit, not the length a run trains at (131,072 for
        # Llama 3.1): the user says the length
        return _hf_model(hf_json), hf_json.parent.name or "hf", None, None
    if Path(args.model).is_file():
        config = load_config(args.model)
        return planned_model(config), Path(args.model).stem, config.data.seq_len, args.model
    raise PlanInputError(f"--model {args.model}: neither a preset ({', '.join(PRESETS)}), a Loom"
                         " config file, nor a Hugging Face model directory or config.json")


def _workload(args: argparse.Namespace):
    if not args.model:
        raise PlanInputError("--model: required (a preset name, a Loom TOML config, or a Hugging"
                             " Face model directory)")
    model, name, default_seq, config_path = _planned(args)
    if args.seq is None and default_seq is None:
        raise PlanInputError(f"--seq: required with a Hugging Face config ({args.model}): its"
                             f" max_position_embeddings ({model.max_seq_len:,}) is a limit, not"
                             " the length to train at")
    seq = default_seq if args.seq is None else args.seq  # (0 was taken as "not given")
    if seq < 1:
        raise PlanInputError(f"--seq {seq}: must be >= 1")
    if not args.global_batch_tokens or args.global_batch_tokens < seq:
        raise PlanInputError(f"--global-batch-tokens {args.global_batch_tokens}: required, at"
                             f" least one sequence of --seq {seq}")
    if args.global_batch_tokens % seq:
        raise PlanInputError(f"--global-batch-tokens {args.global_batch_tokens}: must be a multiple"
                             f" of --seq {seq} (whole sequences per step)")
    return Workload(name, model, seq, args.global_batch_tokens // seq, config_path)


def _cluster(args: argparse.Namespace):
    catalog = load_catalog(args.hardware)
    defaults = catalog[2]
    if args.gpu is None:  # the catalog file's own default, as its docstring promises
        args.gpu = defaults.get("gpu", DEFAULT_GPU)
        if not isinstance(args.gpu, str):
            raise PlanInputError(f"--hardware {args.hardware}: [cluster] gpu = {args.gpu!r}:"
                                 " must be an accelerator's name")
    if args.gpu == "local":
        gpu, link = load_profile(args.profile)
        catalog[0][gpu.name], catalog[1][link.name] = gpu, link
        args.gpu = gpu.name
        args.gpus = args.gpus or args.nproc or gpu.gpus_per_node
    if not args.gpus or args.gpus < 1:
        raise PlanInputError(f"--gpus {args.gpus}: required, >= 1")
    if args.gpus > MAX_GPUS:  # the layouts are the divisors of it: 10^21 searched for ever
        raise PlanInputError(f"--gpus {args.gpus}: at most {MAX_GPUS:,}")
    if args.nics_per_node < 0:
        raise PlanInputError(f"--nics-per-node {args.nics_per_node}: must be >= 0")
    return make_cluster(args.gpu, args.gpus,
                        args.gpus_per_node or defaults.get("gpus_per_node"),
                        intra=args.intra or defaults.get("intra"),
                        inter=args.inter or defaults.get("inter"), catalog=catalog,
                        nics_per_node=args.nics_per_node, network=_topology(args, defaults))


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a plan runs, as it was after. The search
    makes hundreds of thousands of short-lived objects, which reference counting frees, while
    it holds the long-lived ones (caches, schedules of 10^5 actions): each allocation burst
    started a full collection that rescanned all of them, a fifth of the 1T plan's time. The
    planner makes no reference cycles worth collecting sooner."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        print(f"loom plan: unexpected arguments {extra}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.nproc < 0:
            raise PlanInputError(f"--nproc {args.nproc}: must be >= 0 (0: the default)")
        if args.calibrate:
            if args.measure_machine is None:
                raise PlanInputError("--calibrate: this entry point cannot measure the machine")
            path = args.measure_machine(args.nproc or 2, args.profile)
            print(describe(*load_profile(path)))
            print(f"calibration profile written to {path}")
            return 0
        with _cycle_collection_paused():
            return _run(args)
    except (PlanInputError, HardwareError, ConfigError) as err:
        print(f"loom plan: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _site_flags(args: argparse.Namespace, cluster: Cluster) -> tuple | None:
    """``--sites``, ``--site-link`` and ``--outer-steps`` checked (before any search, so a bad
    one costs nothing): (link, outer steps), or None without ``--sites``. The outer steps are
    checked even then: a malformed value is refused, not ignored."""
    try:
        steps = tuple(int(h) for h in args.outer_steps.split(","))
    except ValueError:
        steps = ()
    if not steps or min(steps) < 1:
        raise PlanInputError(f"--outer-steps {args.outer_steps}: integers >= 1, comma-separated")
    if not args.sites:
        return None
    if args.sites < 2 or cluster.gpus % args.sites:
        raise PlanInputError(f"--sites {args.sites}: must be >= 2 and divide --gpus"
                             f" {cluster.gpus}")
    links = load_catalog(args.hardware)[1] if args.hardware else LINKS
    if args.site_link not in links:
        raise PlanInputError(f"--site-link {args.site_link}: unknown link; known:"
                             f" {', '.join(links)}")
    return links[args.site_link], steps


def _sites(args: argparse.Namespace, checked: tuple | None, ranked: list[StepCost],
           model: CostModel) -> tuple | None:
    """``--sites``: the first ranked layout whose replicas split evenly over the sites, priced
    under every dp_mode (``loom.sim.outer_cost``); None without ``--sites``. ``checked``:
    ``_site_flags``'s result, taken before the search."""
    if checked is None:
        return None
    link, steps = checked
    sites = Sites(args.sites, link.bandwidth, link.latency, link.name)
    for cost in ranked:
        lay = cost.layout
        if lay.dp_replicate >= args.sites and lay.dp_replicate % args.sites == 0:
            inner, modes = price_modes(model, lay, sites, steps)
            return lay, sites, inner, modes, recommend(inner, modes)
    raise PlanInputError(f"--sites {args.sites}: no ranked layout has dp_replicate a multiple"
                         f" of {args.sites} (each site holds whole replicas); try --top larger")


def _framework(args: argparse.Namespace) -> Framework:
    """The ``--framework`` profile; another stack's plan ranks its whole space (Loom's config
    rules are Loom's) and writes no Loom config."""
    try:
        chosen = framework(args.framework)
    except ValueError as err:
        raise PlanInputError(str(err)) from None
    if not chosen.is_loom and args.output:
        raise PlanInputError(f"-o {args.output}: writes a Loom config, so only with --framework"
                             f" loom (not {chosen.name})")
    kernel = args.attention_kernel
    if kernel and chosen.is_loom and kernel != chosen.attention_kernel:
        raise PlanInputError(f"--attention-kernel {kernel}: Loom's trainer runs"
                             f" {chosen.attention_kernel} (SDPA's flash kernel); another stack's"
                             " kernel goes with --framework "
                             + ", ".join(name for name in FRAMEWORKS if name != "loom"))
    return dataclasses.replace(chosen, attention_kernel=kernel) if kernel else chosen


def _check_output(path: str) -> None:
    """Refuse ``-o PATH`` before the search when no file can be written there: a folder, or a
    path whose nearest existing folder (``write_chosen`` makes the missing ones) is a file or
    not writable. Writes nothing."""
    target = Path(path)
    if target.is_dir():
        raise PlanInputError(f"-o {path}: is a folder; give a file name")
    existing = target.absolute().parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PlanInputError(f"-o {path}: {existing} is not a writable folder")


def _norm_kernel(args: argparse.Namespace, stack: Framework) -> Framework:
    """``stack`` with ``--norm-kernel``'s choice (after ``--compile``, whose eager profile
    restores the stack's own norm): another stack's norms as one kernel each or as eager ops;
    Loom's trainer runs its own norm, fused only when compiled."""
    if args.norm_kernel is None:
        return stack
    if args.norm_kernel.lower() not in ("true", "false"):
        raise PlanInputError(f"--norm-kernel {args.norm_kernel}: true or false")
    fused = args.norm_kernel.lower() == "true"
    if stack.is_loom and fused != stack.fused_norm:
        raise PlanInputError(f"--norm-kernel {args.norm_kernel}: Loom's trainer runs its own"
                             " RMSNorm (eager ops, one kernel each when --compile true); another"
                             " stack's norm goes with --framework "
                             + ", ".join(name for name in FRAMEWORKS if name != "loom"))
    return dataclasses.replace(stack, fused_norm=fused)


def _compiled(args: argparse.Namespace, stack: Framework) -> tuple[Framework, bool]:
    """``stack`` eager or compiled as ``--compile`` says (default: Loom's from the --model
    config's ``train.compile``, another stack's its profile's), and that choice."""
    if args.compile is None:
        config = args.model and args.model not in PRESETS and Path(args.model).is_file() \
            and _hf_config_path(args.model) is None  # (an HF config says nothing of it)
        compiled = (load_config(args.model).train.compile if config else False) \
            if stack.is_loom else stack.compiled
    elif args.compile.lower() in ("true", "false"):
        compiled = args.compile.lower() == "true"
    else:
        raise PlanInputError(f"--compile {args.compile}: true or false")
    return stack.compiled_as(compiled), compiled


def _run(args: argparse.Namespace) -> int:
    if args.top < 1 or not 0 < args.memory_fraction <= 1:
        raise PlanInputError("--top must be >= 1 and --memory-fraction in (0, 1]")
    if args.explain is not None and not 1 <= args.explain <= args.top:
        raise PlanInputError(f"--explain {args.explain}: a rank of the table, 1 to --top"
                             f" {args.top}")
    stack, compiled = _compiled(args, _framework(args))
    stack = _norm_kernel(args, stack)
    if args.length_dist:
        return _run_varlen(args, stack)
    if args.mixed:
        return _run_mixed(args, stack)
    work, cluster = _workload(args), _cluster(args)
    if args.output:
        _check_output(args.output)
    if args.fp8 not in FP8_RECIPES:
        raise PlanInputError(f"--fp8 {args.fp8}: one of {', '.join(FP8_RECIPES)}")
    fp8 = args.fp8 != "none"
    if fp8 and not cluster.gpu.fp8_flops:
        raise PlanInputError(f"--fp8 {args.fp8}: {cluster.gpu.name} has no FP8 matmuls")
    if args.fp8_all_gather and args.fp8 != "tensorwise":
        raise PlanInputError(f"--fp8-all-gather: gathers weights cast to float8 with one scale"
                             f" per tensor, so needs --fp8 tensorwise (not {args.fp8})")
    work = dataclasses.replace(work, fp8=args.fp8, fp8_all_gather=args.fp8_all_gather,
                               compile=compiled if stack.is_loom else None)
    site_flags = _site_flags(args, cluster)  # refused now, not after the search
    if args.layout:
        layout = _derived_microbatches(parse_layout(args.layout), args.layout, work.global_batch)
        try:  # what the cost model cannot price (a degree below 1, a schedule that cannot
            check_layout_input(layout, work.model, work.seq_len)  # be built, ...)
        except LayoutInputError as err:
            raise PlanInputError(str(err)) from None
        _check_batch(layout, work.global_batch)
        if layout.world != cluster.gpus:
            raise PlanInputError(f"--layout: the degrees multiply to {layout.world}, not --gpus"
                                 f" {cluster.gpus}")
        check_vocab_pp(layout, work)  # the trainer's rules for it (ConfigError: exit 2)
        if layout.zero_stage not in stack.zero_stages:
            raise PlanInputError(f"--layout zero_stage={layout.zero_stage}: --framework"
                                 f" {stack.name} has ZeRO stages"
                                 f" {', '.join(map(str, stack.zero_stages))} only")
        model = CostModel(work.model, work.seq_len, work.global_batch, cluster, framework=stack,
                          fp8=work.fp8, fp8_all_gather=work.fp8_all_gather)
        cost = simulate_step(model, model.evaluate(layout))
        # the budget ``plan`` keeps: a stack's allocator reserve leaves its fragments out
        budget = cluster.gpu.memory_bytes * min(args.memory_fraction,
                                                1.0 - stack.allocator_reserve)
        result = Plan(work, cluster, budget, [cost], 1, int(cost.memory_total <= budget))
        print(explain.to_json(result) if args.json else explain.breakdown(result, cost))
        return 0
    model = CostModel(work.model, work.seq_len, work.global_batch, cluster, framework=stack,
                      fp8=work.fp8, fp8_all_gather=work.fp8_all_gather)
    result = plan(work, cluster, top=args.top, memory_fraction=args.memory_fraction,
                  runnable_only=not args.any and stack.is_loom, cost_model=model)
    if not stack.is_loom and not args.json:
        print(f"priced as {stack.name} (loom.sim.frameworks): its memory layout and overlap")
    sites = _sites(args, site_flags, result.ranked, model)
    if args.json and sites:
        table = json.loads(explain.to_json(result))
        table["sites"] = explain.sites_json(*sites)
        print(json.dumps(table))
    elif args.json:
        print(explain.to_json(result))
    else:
        print(explain.table(result))
        if sites:
            print()
            print(explain.sites_table(*sites))
    if args.explain and result.ranked:
        if args.explain > len(result.ranked):  # before -o writes anything
            raise PlanInputError(f"--explain {args.explain}: the table has"
                                 f" {len(result.ranked)} rows")
        print()
        print(explain.breakdown(result, result.ranked[args.explain - 1]))
    if args.output and result.ranked:
        try:
            command = explain.write_chosen(result, result.ranked[0], args.output)
        except OSError as err:  # what the check before the search cannot see (/proc, a full disk)
            raise PlanInputError(f"-o {args.output}: cannot be written ({err.strerror})") from None
        print(f"\nwrote {args.output}; launch with:\n  {command}")
    return 0 if result.ranked else 1


def _run_mixed(args: argparse.Namespace, stack: Framework) -> int:
    """``--mixed``: rank pipelines over a cluster of unlike accelerators and data parallelism
    across it (``loom.plan.mixed``, ``loom.plan.mixed_dp``)."""
    given = [("--gpu", args.gpu), ("--layout", args.layout), ("-o", args.output),
             ("--explain", args.explain), ("--sites", args.sites),
             ("--fp8-all-gather", args.fp8_all_gather),  # (its parts' replicas price none)
             ("--length-dist", args.length_dist), ("--calibrate", args.calibrate),
             ("--gpus-per-node", args.gpus_per_node), ("--intra", args.intra),
             ("--inter", args.inter), ("--nics-per-node", args.nics_per_node)]
    given += [(flag, getattr(args, flag[2:].replace("-", "_"), None))
              for flag, _, _ in TOPOLOGY_FLAGS]
    for flag, value in given:
        if value:
            raise PlanInputError(f"{flag}: not with --mixed (its file names each part's"
                                 " accelerators and links, and it ranks layouts over them)")
    try:
        mixed = load_mixed(args.mixed, load_catalog(args.hardware))
    except MixedClusterError as err:
        raise PlanInputError(str(err)) from None
    if args.gpus and args.gpus != mixed.gpus:
        raise PlanInputError(f"--gpus {args.gpus}: the --mixed file's parts hold {mixed.gpus}")
    if args.fp8 not in FP8_RECIPES:
        raise PlanInputError(f"--fp8 {args.fp8}: one of {', '.join(FP8_RECIPES)}")
    fp8 = args.fp8 != "none"
    slow = [c.gpu.name for c in mixed.parts if fp8 and not c.gpu.fp8_flops]
    if slow:
        raise PlanInputError(f"--fp8 {args.fp8}: {slow[0]} has no FP8 matmuls")
    work = _workload(args)
    ranked = rank_mixed(work, mixed, framework=stack, fp8=args.fp8,
                        memory_fraction=args.memory_fraction, top=args.top)
    print(report(work, mixed, ranked, args.json))
    return 0 if ranked else 1


def _run_varlen(args: argparse.Namespace, stack: Framework) -> int:
    """``--length-dist``: rank the balances of variable-length steps (``loom.plan.varlen``)."""
    for flag, value in (("--layout", args.layout), ("-o", args.output),
                        ("--explain", args.explain)):
        if value:
            raise PlanInputError(f"{flag}: not with --length-dist (it ranks balances, not"
                                 " layouts of equal sequences)")
    # what the balances' per-token costs do not price: refused, not silently left out
    for flag, value in (("--fp8", args.fp8 if args.fp8 != "none" else None),
                        ("--fp8-all-gather", args.fp8_all_gather), ("--mixed", args.mixed),
                        ("--sites", args.sites)):
        if value:
            given = flag if value is True else f"{flag} {value}"
            raise PlanInputError(f"{given}: not with --length-dist (its balances are priced at"
                                 " the 16-bit matmul rate on one kind of accelerator, one site)")
    dist = load_length_distribution(args.length_dist)
    if not args.global_batch_tokens or args.global_batch_tokens < 1:
        raise PlanInputError(f"--global-batch-tokens {args.global_batch_tokens}: required with"
                             " --length-dist, >= 1")
    if not args.model:
        raise PlanInputError("--model: required (a preset name, a Loom TOML config, or a Hugging"
                             " Face model directory)")
    model, name, _, _ = _planned(args)
    print(varlen.run(model, name, _cluster(args), dist, args.global_batch_tokens, stack,
                     args.json))
    return 0


__all__ = ["add_plan_commands", "parse_layout", "PlanInputError"]


def main(argv: list[str] | None = None) -> int:
    """``loom plan ...`` without the rest of ``loom`` (``loom.__main__`` sends it here, so the
    planner never imports torch); ``--calibrate`` needs the trainer and goes through
    ``loom.cli``."""
    parser = OneLineParser(prog="loom")
    add_plan_commands(parser.add_subparsers(dest="command", required=True))
    try:
        args, extra = parser.parse_known_args(argv)
        return args.handler(args, extra)
    except SystemExit as exit_:  # argparse: --help (0) or a bad argument (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
