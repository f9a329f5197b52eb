"""``loom schedule list | show | export | simulate | search``: pipeline schedules from the command line.

``add_schedule_commands(subparsers)`` registers the ``schedule`` command on the top-level
``loom`` parser (``loom/cli.py`` wires it in); ``main(argv)`` runs these commands on their own,
for tests and for ``python -m loom.pipeline.cli``. Handlers take ``(args, extra)`` like the
other ``loom`` commands.

A schedule is named by its family (``1f1b``, ``zbv``, ... see ``list``) with ``--pp``,
``--microbatches`` and, for families that take it, ``--chunks``; or by a schedule file written by
``export`` (``.json``, or torch's ``.csv``, named after the file). Costs are
``--costs F,I,W[,LATENCY]``, the durations of one *full stage* (a rank's share of the model when it
holds one stage) in every command: a rank that holds v chunks spends 1/v of them on each
(``loom.schedule.cost.full_stage_costs``, the search's own split), so the same flag means the same
model in ``show``, ``simulate`` and ``search``. ``--cost-file`` (JSON or CSV, see
``loom.schedule.cost.StageCosts.from_file``) gives ``show``/``simulate`` the costs of every global
stage as they are, and ``search`` one row per rank of full-stage costs. A bad argument prints one
line naming it and exits with code 2.

Wide pipelines: from p = ``SUMMARY_FROM_PP`` ranks (or with ``--summary``) ``show`` and
``simulate`` print a per-rank summary (utilisation bars and peak memory) instead of the step grid,
which no longer fits a terminal; ``--gantt`` asks for the grid anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
from typing import Any

from loom.errors import OneLineParser, path_arg, read_input_text
from loom.schedule.cost import StageCosts, full_stage_costs, parse_cost_spec
from loom.schedule.families import get, names, routed, simulation_only
from loom.schedule.ir import MAX_STEP_CELLS, Op, Schedule, csv_text
from loom.schedule.render import render_gantt, summary_text, write_chrome_trace
from loom.schedule.search import DEFAULT_EFFORT, search
from loom.schedule.search_places import MAX_CHUNKS, PLACEMENTS, SearchError
from loom.schedule.simulate import simulate
from loom.schedule.validate import ScheduleError, format_grid, validate

EXIT_USAGE = 2
# From this many ranks show/simulate print the per-rank summary instead of the step grid.
SUMMARY_FROM_PP = 16
# --costs help, shared by every command: one meaning everywhere (see the module docstring)
FULL_STAGE_COSTS = ("of one full stage (a rank's whole share of the model; a rank holding v "
                    "chunks spends 1/v of them on each)")


class UsageError(Exception):
    """A bad argument: ``argument`` names it, the message says why."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"{argument}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip():
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _takes_chunks(family: str) -> bool:
    return "chunks" in inspect.signature(get(family)).parameters


def _add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that pick a schedule and its costs (shared by show/export/simulate)."""
    parser.add_argument("name", type=path_arg,
                        help="schedule family (see `loom schedule list`) or a schedule "
                             "file written by `export` (.json or torch .csv)")
    parser.add_argument("--pp", type=_positive_int, help="pipeline ranks (required for a family)")
    parser.add_argument("--microbatches", "-m", type=_positive_int,
                        help="microbatches per step (default: 2 x --pp)")
    parser.add_argument("--chunks", type=_positive_int,
                        help="stages per rank, for families that take it (interleaved_1f1b, "
                             "looped_bfs; hanayo: one-way sweeps of its waves, an even count)")
    _add_cost_arguments(parser, FULL_STAGE_COSTS,
                        "per-stage costs, one row per global stage, used as given")
    parser.add_argument("--memory-limit", type=_positive_float, metavar="UNITS",
                        help="fail if a rank's peak activation memory exceeds UNITS (one rank's "
                             "activations for one microbatch = 1)")


def _add_cost_arguments(parser: argparse.ArgumentParser, where: str, per_file: str) -> None:
    """--costs F,I,W[,LATENCY] or --cost-file (one of them)."""
    costs = parser.add_mutually_exclusive_group()
    costs.add_argument("--costs", default="1,1,1", metavar="F,I,W[,LATENCY]",
                       help=f"durations of F, I, W {where} (B = I + W) and the send latency "
                            "between ranks (default 1,1,1)")
    costs.add_argument("--cost-file", type=path_arg, metavar="PATH",
                       help=f"{per_file}, JSON or CSV with columns F,I,W[,B]")


def _add_view_arguments(parser: argparse.ArgumentParser) -> None:
    """--summary / --gantt: which text view of the pipeline to print (see ``_view``)."""
    view = parser.add_mutually_exclusive_group()
    view.add_argument("--summary", action="store_true",
                      help="print per-rank utilisation bars and peak memory (the default from "
                           f"--pp {SUMMARY_FROM_PP})")
    view.add_argument("--gantt", action="store_true",
                      help="print the full rank-by-step grid (the default for show below "
                           f"--pp {SUMMARY_FROM_PP})")


def add_schedule_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``schedule`` and its sub-commands on ``subparsers`` (from ``add_subparsers``)."""
    schedule = subparsers.add_parser(
        "schedule", help="list, draw, export and simulate pipeline schedules",
        description="List, draw, export and simulate pipeline schedules.")
    sub = schedule.add_subparsers(dest="schedule_command", required=True,
                                  parser_class=OneLineParser, metavar="COMMAND")

    listing = sub.add_parser("list", help="the schedule families and their valid sizes")
    listing.set_defaults(handler=_list)

    show = sub.add_parser("show", help="print the rank-by-step grid, or draw a Gantt chart")
    _add_schedule_arguments(show)
    show.add_argument("-o", "--output", type=path_arg, metavar="FILE",
                      help="draw to FILE: .png, .svg or .html (Gantt chart with memory), or "
                           ".json (Chrome / Perfetto trace)")
    _add_view_arguments(show)
    show.set_defaults(handler=_show)

    export = sub.add_parser("export", help="write the schedule file")
    _add_schedule_arguments(export)
    export.add_argument("--format", choices=("torch-csv", "json"),
                        help="torch's compute-only CSV or Loom's JSON (default: from the -o "
                             "suffix, else torch-csv)")
    export.add_argument("-o", "--output", type=path_arg, metavar="FILE",
                        help="write here (default: stdout)")
    export.set_defaults(handler=_export)

    simulate = sub.add_parser("simulate", help="print makespan, bubbles and peak memory")
    _add_schedule_arguments(simulate)
    simulate.add_argument("--json", action="store_true", help="print the figures as JSON")
    simulate.add_argument("-o", "--output", type=path_arg, metavar="FILE",
                          help="also write the full result (timeline, memory curves) as JSON")
    _add_view_arguments(simulate)
    simulate.set_defaults(handler=_simulate)

    search = sub.add_parser("search", help="find the shortest schedule under a memory limit")
    search.add_argument("--pp", type=_positive_int, required=True, help="pipeline ranks")
    search.add_argument("--microbatches", "-m", type=_positive_int,
                        help="microbatches per step (default: 2 x --pp)")
    _add_cost_arguments(search, FULL_STAGE_COSTS, "full-stage costs, one row per rank")
    search.add_argument("--memory-limit", type=_positive_float, required=True, metavar="UNITS",
                        help="peak activation units per rank (1F1B needs --pp; minimum 1)")
    search.add_argument("--placement", default="any", choices=("any", *PLACEMENTS),
                        help="looped (1 stage per rank), interleaved (2, looped), v (2, V shape)")
    search.add_argument("--layers", type=_positive_int, metavar="N",
                        help="the model's layers: at most N // --pp stages per rank, as "
                        f"parallel.schedule = \"search\" allows (default: up to {MAX_CHUNKS})")
    search.add_argument("--effort", type=_positive_int, default=DEFAULT_EFFORT,
                        help=f"simulated actions to spend (default {DEFAULT_EFFORT}; "
                        "the patient pass adds a quarter)")
    search.add_argument("--time-budget", type=_positive_float, metavar="SECONDS",
                        help="also stop after this long (the result may then vary by machine)")
    search.add_argument("--offload", action="store_true",
                        help="also weigh PipeOffload: the fastest schedules over the limit with "
                        "offloads and reloads that make them fit, priced on the host link")
    search.add_argument("--host-copy-time", type=_positive_float, metavar="TIME",
                        help="with --offload: how long one activation unit takes to copy to or "
                        "from the host, in the units of --costs (default: a --cost-file's "
                        "host_bandwidth and host_unit_bytes)")
    search.add_argument("--format", choices=("torch-csv", "json"),
                        help="file format for -o (default: from the suffix, else torch-csv)")
    search.add_argument("-o", "--output", type=path_arg, metavar="FILE",
                        help="write the schedule here")
    search.add_argument("--json", action="store_true", help="print the result as JSON")
    search.set_defaults(handler=_search)
    return schedule


# ----------------------------------------------------------------------------------------------
# Handlers: (args, extra) -> exit code


def _run(handler: Any) -> Any:
    """Turn a UsageError into one line on stderr and exit code 2."""

    def wrapped(args: argparse.Namespace, extra: list[str]) -> int:
        try:
            if extra:
                raise UsageError("arguments", f"unexpected {' '.join(extra)}")
            if getattr(args, "output", None):
                _check_output(args.output)
            return handler(args)
        except UsageError as err:
            print(f"loom schedule {args.schedule_command}: {err}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as err:  # a path the checks above could not foresee (e.g. under /proc)
            where = err.filename or getattr(args, "output", None) or "output"  # ENOSPC: no name
            print(f"loom schedule {args.schedule_command}: {where}: {err.strerror}",
                  file=sys.stderr)
            return EXIT_USAGE

    return wrapped


@_run
def _list(args: argparse.Namespace) -> int:
    width = max(len(name) for name in names() + routed() + simulation_only())
    for name in names() + routed() + simulation_only():
        doc = (inspect.getdoc(get(name)) or "").splitlines()[0]
        chunks = " [--chunks]" if _takes_chunks(name) else ""
        only = " [simulation only: not trainable]" if name in simulation_only() else ""
        only += " [two model copies: CSV with a routes row]" if name in routed() else ""
        print(f"{name:<{width}}  {doc}{chunks}{only}")
    return 0


@_run
def _show(args: argparse.Namespace) -> int:
    schedule = _load(args)
    result = _simulated(args, schedule)
    if not args.output:
        if _view(args, schedule, default="gantt") == "gantt":
            print("order, one step per action (-o chart.png draws the timed Gantt chart):")
            print(format_grid(schedule, max_steps=10_000))
            print(_summary_line(result))
        else:  # the per-rank lines already list the peaks
            _print_summary(result)
            print(_summary_line(result, per_rank=False))
        return 0
    path = args.output
    if path.lower().endswith(".json"):
        write_chrome_trace(result, path)
    else:
        try:
            render_gantt(schedule, result, path, source=_source(args))
        except ValueError as err:
            raise UsageError("-o", str(err)) from None
    print(f"wrote {path}  ({_summary_line(result)})")
    return 0


@_run
def _export(args: argparse.Namespace) -> int:
    schedule = _load(args)
    if args.memory_limit is not None:
        _simulated(args, schedule)
    fmt = args.format or ("json" if (args.output or "").lower().endswith(".json") else "torch-csv")
    try:
        text = schedule.to_json() + "\n" if fmt == "json" else csv_text(schedule)
    except ValueError as err:  # e.g. routes, which torch's CSV cannot express
        raise UsageError("--format", str(err)) from None
    if args.output:
        with open(args.output, "w", newline="") as handle:
            handle.write(text)
        print(f"wrote {args.output} ({fmt}, {schedule.pp_size} ranks)")
    else:
        sys.stdout.write(text)
    return 0


@_run
def _simulate(args: argparse.Namespace) -> int:
    schedule = _load(args)
    result = _simulated(args, schedule)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(result.to_json(indent=1))
    if args.json:
        print(json.dumps(result.summary(), indent=2))
        return 0
    figures = result.summary()
    print(f"{result.name}: p={result.pp_size} m={result.num_microbatches} "
          f"stages={result.num_stages}; costs {result.costs}")
    print(f"makespan           {figures['makespan']:g}")
    print(f"bubble (ZB)        {figures['bubble_zb']:.4f}  idle {figures['bubble_time_zb']:g} "
          "in the longest rank span")
    print(f"bubble (makespan)  {figures['bubble_makespan']:.4f}  makespan minus the busiest "
          "rank's work")
    view = _view(args, schedule, default="figures")
    if view == "summary":  # per-rank lines instead of two rows of p numbers
        _print_summary(result)
        return 0
    print(f"peak memory        {_numbers(figures['peak_memory'])}  (per rank; 1 = one rank's "
          "activations for one microbatch)")
    print(f"busy               {_numbers(figures['busy'])}")
    if view == "gantt":
        print("order, one step per action:")
        print(format_grid(schedule, max_steps=10_000))
    return 0


@_run
def _search(args: argparse.Namespace) -> int:
    microbatches = args.microbatches or 2 * args.pp
    costs = _costs(args)
    max_chunks = MAX_CHUNKS
    if args.layers is not None:
        if args.layers < args.pp:
            raise UsageError("--layers", f"{args.layers} layers cannot give each of the --pp "
                             f"{args.pp} ranks a stage; use --layers >= {args.pp}")
        max_chunks = min(MAX_CHUNKS, args.layers // args.pp)
    _check_size(args.pp, microbatches, max_chunks, "the most the search tries")
    if args.host_copy_time is not None:
        if not args.offload:
            raise UsageError("--host-copy-time", "prices offloads: give it with --offload")
        costs = dataclasses.replace(costs, host_bandwidth=1 / args.host_copy_time,
                                    host_unit_bytes=1)
    if args.offload and costs.host_bandwidth is None:
        raise UsageError("--offload", "needs the host link's speed: --host-copy-time TIME, or "
                         "host_bandwidth and host_unit_bytes in --cost-file")
    try:
        found = search(args.pp, microbatches, costs, args.memory_limit, args.placement,
                       max_chunks=max_chunks, effort=args.effort, time_budget_s=args.time_budget,
                       offload=args.offload)
    except SearchError as err:
        flag = {"memory_limit": "--memory-limit", "max_chunks": "--layers", "pp": "--pp",
                "microbatches": "--microbatches", "placement": "--placement",
                "costs": "--cost-file" if args.cost_file else "--costs"}[err.argument]
        raise UsageError(flag, str(err)) from None
    schedule = found.schedule
    if args.output:
        fmt = args.format or ("json" if args.output.lower().endswith(".json") else "torch-csv")
        text = schedule.to_json() + "\n" if fmt == "json" else csv_text(schedule)
        with open(args.output, "w", newline="") as handle:
            handle.write(text)
    if args.json:
        print(json.dumps(found.summary(), indent=2))
        return 0
    print(f"{schedule.name}: p={args.pp} m={microbatches} placement={found.best.placement}, "
          f"{found.candidates_tried} candidates; full-stage costs {costs.describe()}")
    print(_summary_line(found.figures) + f" (limit {args.memory_limit:g})")
    if schedule.has_transfers:  # --offload: the winner moves activations to the host
        print(f"offloads {found.summary()['offloads']} (each reloaded) on a host link of "
              f"{float(costs.transfer_time(schedule, 0) * schedule.chunks_per_rank):g} per unit")
    for rank, candidate in enumerate(found.leaderboard, 1):
        print(f"  {rank}. {candidate.label:<60} makespan {candidate.makespan:g}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


# ----------------------------------------------------------------------------------------------
# Shared steps


def _check_output(path: str) -> None:
    """Refuse ``-o PATH`` that cannot be written (a folder, a missing or read-only folder)
    before any work, so a bad path is one line and exit 2 rather than a traceback after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError("-o", f"{path} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise UsageError("-o", f"{path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError("-o", f"{path}: not writable")


def _check_size(pp: int, microbatches: int, chunks: int, which: str,
                file: str | None = None) -> None:
    """Refuse a step larger than ``MAX_STEP_CELLS`` ranks x microbatches x stages per rank
    (``which`` says where the stages per rank come from; ``file``: the schedule file that
    holds the step, named instead of the flags)."""
    cells = pp * microbatches * chunks
    if cells > MAX_STEP_CELLS:
        sizes = (f"{pp} ranks x {microbatches} microbatches" if file else
                 f"--pp {pp} x --microbatches {microbatches}")
        raise UsageError(file or "--pp", f"{sizes} x {chunks} stages per rank ({which}) ="
                         f" {cells:,}: at most {MAX_STEP_CELLS:,} (a larger step takes minutes"
                         " to build; published pipelines have p <= 128, m <= 4096)")


def _view(args: argparse.Namespace, schedule: Schedule, default: str) -> str:
    """"summary", "gantt" or ``default``: what the flags ask for, else the summary from
    ``SUMMARY_FROM_PP`` ranks (a grid of p rows no longer reads on a terminal)."""
    if args.summary:
        return "summary"
    if args.gantt:
        return "gantt"
    return "summary" if schedule.pp_size >= SUMMARY_FROM_PP else default


def _print_summary(result: Any) -> None:
    print(f"per rank ({result.pp_size} ranks; --gantt prints every step, -o chart.png draws the "
          "timed chart):")
    print(summary_text(result))


def _source(args: argparse.Namespace) -> str:
    """Where the schedule came from, when it is a file (the chart's subtitle)."""
    return args.name if _is_file(args.name) else ""


def _is_file(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in (".json", ".csv")


def _load(args: argparse.Namespace) -> Schedule:
    """The schedule named by ``args.name``: a family built with --pp/-m/--chunks, or a file."""
    if _is_file(args.name):
        schedule = _load_file(args)
    else:
        schedule = _build(args)
    try:
        validate(schedule)
    except ScheduleError as err:
        # One line names the rule; the grid that marks the broken action (as long as the
        # schedule) is printed only when asked for.
        if getattr(args, "gantt", False):
            print(err.grid, file=sys.stderr)
        hint = "" if not hasattr(args, "gantt") or args.gantt else (
            " (show --gantt also prints the step grid with it marked)")
        raise UsageError(args.name, f"[{err.rule}] {err.reason}{hint}") from None
    return schedule


def _build(args: argparse.Namespace) -> Schedule:
    try:
        generator = get(args.name)
    except KeyError as err:
        raise UsageError("name", str(err.args[0])) from None
    if args.pp is None:
        raise UsageError("--pp", f"required to build {args.name} (pipeline ranks, e.g. --pp 4)")
    options = {}
    if args.chunks is not None:
        if not _takes_chunks(args.name):
            takes = ", ".join(n for n in names() if _takes_chunks(n))
            raise UsageError("--chunks", f"{args.name} has a fixed number of stages per rank; "
                                         f"families with --chunks: {takes}")
        options["chunks"] = args.chunks
    microbatches = args.microbatches or 2 * args.pp
    _check_size(args.pp, microbatches, args.chunks or 2,
                "--chunks" if args.chunks else "at most 2 without --chunks")
    try:
        return generator(args.pp, microbatches, **options)
    except ValueError as err:
        text = str(err)
        # the flag of the quantity the message is about: the first one it names (its reasons
        # may name others: bitpipe's pp_size rule explains itself in microbatches)
        named = [(text.find(word), flag) for word, flag in (
            ("microbatches", "--microbatches"), ("chunks", "--chunks"), ("pp_size", "--pp"))
            if word in text]
        raise UsageError(min(named)[1] if named else "arguments", text) from None


def _load_file(args: argparse.Namespace) -> Schedule:
    try:
        if args.name.lower().endswith(".json"):
            schedule = Schedule.from_json(read_input_text(args.name))
        else:
            schedule = Schedule.from_torch_csv(args.name, num_microbatches=args.microbatches)
    except (OSError, ValueError, KeyError) as err:
        raise UsageError(args.name, f"cannot read the schedule: {err}") from None
    if args.pp is not None and args.pp != schedule.pp_size:
        raise UsageError("--pp", f"{args.pp} given but {args.name} has {schedule.pp_size} ranks")
    # Every stage of a route runs F once per microbatch, so the file's own actions bound the
    # step it can describe; a larger num_microbatches would only make the checks run for ever.
    forwards = sum(action.op is Op.F for row in schedule.actions for action in row)
    needed = schedule.stages_per_route * schedule.num_microbatches
    if needed > forwards:
        raise UsageError(args.name, f"num_microbatches={schedule.num_microbatches} x"
                         f" {schedule.stages_per_route} stages = {needed:,} forwards, but the file"
                         f" has {forwards:,} F actions (every stage runs F once per microbatch)")
    _check_size(schedule.pp_size, schedule.num_microbatches, schedule.chunks_per_rank,
                "the file's", file=args.name)
    return schedule


def _costs(args: argparse.Namespace) -> Any:
    if args.cost_file:
        try:
            return StageCosts.from_file(args.cost_file)
        except (OSError, ValueError, KeyError) as err:
            raise UsageError("--cost-file", str(err)) from None
    try:
        return parse_cost_spec(args.costs)
    except ValueError as err:
        raise UsageError("--costs", str(err)) from None


def _simulated(args: argparse.Namespace, schedule: Schedule) -> Any:
    """Simulate with the given costs, then enforce --memory-limit on the simulated peaks.

    ``--costs`` are full-stage costs, split over each rank's chunks as the search splits them;
    a ``--cost-file`` names every global stage's costs and is used as it is.
    """
    given = _costs(args)
    try:
        costs = given if args.cost_file else full_stage_costs(given, schedule)
        result = simulate(schedule, costs)
    except ValueError as err:  # costs that do not fit the schedule
        raise UsageError("--cost-file" if args.cost_file else "--costs", str(err)) from None
    if not args.cost_file and schedule.chunks_per_rank > 1:
        result = dataclasses.replace(result, costs=f"full stage {given.describe()}, a chunk of "
                                                   "v takes 1/v")
    _check_memory(args, result)
    return result


def _check_memory(args: argparse.Namespace, result: Any) -> None:
    if args.memory_limit is None:
        return
    peak = max(result.peak_memory)
    if peak > args.memory_limit:
        rank = list(result.peak_memory).index(peak)
        raise UsageError("--memory-limit", f"{result.name} peaks at {float(peak):g} activation "
                         f"units on rank {rank}, over the limit of {args.memory_limit:g}")


def _numbers(values: list[float]) -> str:
    return " ".join(f"{v:g}" for v in values)


def _summary_line(result: Any, per_rank: bool = True) -> str:
    peaks = [float(m) for m in result.peak_memory]
    memory = _numbers(peaks) if per_rank else f"{max(peaks, default=0):g} at most"
    return (f"makespan {float(result.makespan):g}, bubble ZB {float(result.bubble_zb):.1%}, "
            f"makespan-bubble {float(result.bubble_makespan):.1%}, peak memory {memory}")


def main(argv: list[str] | None = None) -> int:
    """Run ``schedule ...`` commands without the rest of ``loom`` (tests, ``python -m``)."""
    parser = OneLineParser(prog="loom")
    add_schedule_commands(parser.add_subparsers(dest="command", required=True))
    try:
        args, extra = parser.parse_known_args(argv)
        return args.handler(args, extra)
    except SystemExit as exit_:  # argparse: --help (0) or a bad argument (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
