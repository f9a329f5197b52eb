"""Draw a simulated (or measured) pipeline timeline: Gantt chart files and Chrome / Perfetto traces.

``render_gantt(schedule, result, path)`` writes PNG or SVG (matplotlib, Agg backend, imported only
here and only when drawing) or a self-contained HTML page with the SVG inline. One row per rank,
one box per action coloured by op, the microbatch number inside, later chunks of a rank in a
lighter shade of the same colour, and the rank's activation memory as a step curve under its row.

``to_chrome_trace(result)`` gives the same timeline as Chrome trace-event JSON (open it in
``chrome://tracing`` or https://ui.perfetto.dev): one process per pipeline rank, one complete
("X") event per action. ``OP_COLORS`` and ``OP_CNAMES`` are one palette: the hex colours are the
trace viewer's reserved ``rail_*`` colours, so a real run that builds its events with
``trace_event`` lines up with the predicted chart colour for colour.
"""

from __future__ import annotations

import html
import io
import json
import os
from collections.abc import Mapping
from typing import Any

from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.simulate import SimResult, simulate

# Op -> colour, shared by the Gantt chart and the traces (F blue, B red, I orange, W green).
OP_COLORS: Mapping[str, str] = {"F": "#4387fd", "B": "#f44a3f", "I": "#ee8e00", "W": "#0da861",
                                 # PipeOffload's host copies (loom.schedule.offload)
                                 "O": "#b67d8f", "R": "#c79b7d",
                                 # vocabulary parallelism's output-layer passes (vocab_passes)
                                 "S": "#8e6bd0", "T": "#d06bb6"}
# Op -> Chrome trace-viewer reserved colour name with (about) the same colour as OP_COLORS.
OP_CNAMES: Mapping[str, str] = {
    "F": "rail_response", "B": "rail_animation", "I": "rail_idle", "W": "rail_load",
    "O": "thread_state_uninterruptible", "R": "thread_state_unknown",
    "S": "thread_state_iowait", "T": "thread_state_runnable",
}
MEMORY_COLOR = "#6a3d9a"


def chunk_of(placement: tuple[int, ...], stage: int) -> int:
    """Which of its rank's stages ``stage`` is (0 for the first, in stage order)."""
    rank = placement[stage]
    return sum(1 for s in range(stage) if placement[s] == rank)


def shade(color: str, chunk: int, chunks: int) -> str:
    """``color`` for chunk 0, mixed towards white for later chunks (at most 55% white)."""
    if chunks <= 1 or chunk == 0:
        return color
    mix = 0.55 * chunk / (chunks - 1)
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _text_color(color: str) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "white"


def title_of(result: SimResult, source: str = "") -> str:
    """The chart's title: the schedule's own name and its figures, then a subtitle line with
    the costs and, when given, where the schedule came from (a file: its CSV has no name)."""
    v = max(result.placement.count(r) for r in range(result.pp_size)) if result.placement else 1
    chunks = f" v={v}" if v > 1 else ""
    origin = f"  (from {source})" if source else ""
    return (
        f"{result.name}  p={result.pp_size} m={result.num_microbatches}{chunks}  "
        f"makespan={float(result.makespan):g}  bubble ZB={float(result.bubble_zb):.1%}  "
        f"makespan-bubble={float(result.bubble_makespan):.1%}\ncosts: {result.costs}{origin}"
    )


# The text summary: a bar of this many characters per rank, '#' busy and '.' idle.
SUMMARY_BAR_WIDTH = 40


def summary_text(result: SimResult, width: int = SUMMARY_BAR_WIDTH) -> str:
    """Per-rank utilisation bars and peak memory, one line per rank, for pipelines too wide for
    the step grid (what ``loom schedule show|simulate`` prints from p = 16, or with --summary).

    Utilisation is the rank's compute time over the makespan; the bar rounds it to ``width``
    characters. Peak memory is in the validator's units (one rank's activations for one
    microbatch = 1).
    """
    makespan = float(result.makespan) or 1.0
    busy = [float(b) / makespan for b in result.busy]
    peaks = [float(m) for m in result.peak_memory]
    digits = len(str(max(result.pp_size - 1, 0)))
    lines = [f"{'rank':>{max(4, digits)}}  {'utilisation':<{width}}  {'busy':>6}  peak memory"]
    for rank, (fraction, peak) in enumerate(zip(busy, peaks)):
        filled = round(fraction * width)
        bar = "#" * filled + "." * (width - filled)
        lines.append(f"{rank:>{max(4, digits)}}  {bar}  {fraction:>6.1%}  {peak:g}")
    mean = sum(busy) / len(busy) if busy else 0.0
    lines.append(f"mean utilisation {mean:.1%}, lowest {min(busy, default=0):.1%} "
                 f"(rank {busy.index(min(busy)) if busy else 0}); highest peak memory "
                 f"{max(peaks, default=0):g} (rank {peaks.index(max(peaks)) if peaks else 0})")
    return "\n".join(lines)


# The drawn chart's limits: one box per action, two axes per rank. Measured on 2 cores (1F1B,
# `loom schedule show -o x.png`): 2,048 actions took 11 s over 16 ranks and 18 s over 32;
# 4,096 took 21 s over 16 and 39 s over 32; 8,192 over 64 ranks took 159 s.
MAX_DRAWN_RANKS = 32
MAX_DRAWN_ACTIONS = 4096


def render_gantt(
    schedule: Schedule, result: SimResult | None, path: str | os.PathLike, dpi: int = 130,
    source: str = "", max_actions: int = MAX_DRAWN_ACTIONS,
) -> None:
    """Write the Gantt chart of ``result`` (simulated with unit costs if None) to ``path``.

    The format follows the suffix: ``.png``, ``.svg`` or ``.html``. The title names the
    schedule (``Schedule.name``); ``source`` (e.g. the file it was read from) goes in the
    subtitle. ``max_actions``: what the chart may hold (``loom schedule`` keeps the default;
    a caller that knows its chart is worth the minutes may raise it).
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg", ".html"):
        raise ValueError(f"cannot draw {path!r}: use a .png, .svg or .html file")
    actions = sum(len(row) for row in schedule.actions)
    if schedule.pp_size > MAX_DRAWN_RANKS or actions > max_actions:
        raise ValueError(f"cannot draw {schedule.pp_size} ranks and {actions:,} actions: at most"
                         f" {MAX_DRAWN_RANKS} ranks and {max_actions:,} actions (matplotlib"
                         " takes minutes beyond); write a .json Chrome trace (Perfetto) instead")
    result = result if result is not None else simulate(schedule)
    figure = gantt_figure(schedule, result, source)
    import matplotlib.pyplot as plt

    try:
        if suffix == ".html":
            buffer = io.StringIO()
            figure.savefig(buffer, format="svg", bbox_inches="tight")
            with open(path, "w") as handle:
                handle.write(_html_page(result, buffer.getvalue(), source))
        else:
            figure.savefig(path, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(figure)


def gantt_figure(schedule: Schedule, result: SimResult, source: str = "") -> Any:
    """The matplotlib Figure behind ``render_gantt`` (for notebooks and further styling)."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; a no-op if a backend is in use
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = result.pp_size
    makespan = float(result.makespan) or 1.0
    longest_row = max((len(row) for row in result.timeline), default=1)
    width = min(40.0, max(10.0, 0.3 * longest_row))
    figure, axes = plt.subplots(
        2 * p, 1, sharex=True, figsize=(width, 1.05 * p + 1.2),
        gridspec_kw={"height_ratios": [1.0, 0.55] * p, "hspace": 0.08},
        squeeze=False,
    )
    axes = axes[:, 0]
    chunks = max(schedule.placement.count(r) for r in range(p))
    top_memory = max((float(m) for m in result.peak_memory), default=1.0) or 1.0
    points_per_unit = width * 72 * 0.85 / makespan  # horizontal space of one time unit
    for rank in range(p):
        bars, memory = axes[2 * rank], axes[2 * rank + 1]
        for slot in result.timeline[rank]:
            _draw_slot(bars, slot.action, float(slot.start), float(slot.duration),
                       schedule.placement, chunks, points_per_unit)
        bars.set_ylim(0, 1)
        bars.set_yticks([0.5], [f"rank {rank}"])
        bars.tick_params(axis="y", length=0)
        _draw_memory(memory, result, rank, makespan, top_memory)
    axes[-1].set_xlim(0, makespan)
    axes[-1].set_xlabel("time")
    handles = [Patch(color=OP_COLORS[op.value], label=op.value) for op in Op
               if any(s.action.op is op for row in result.timeline for s in row)]
    if chunks > 1:
        handles.append(Patch(color=shade("#808080", chunks - 1, chunks),
                             label=f"lighter: later chunk (v={chunks})"))
    handles.append(Patch(color=MEMORY_COLOR, alpha=0.35, label="activation memory"))
    axes[0].legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.02),
                   ncol=len(handles), frameon=False, fontsize=8)
    axes[0].set_title(title_of(result, source), fontsize=10, pad=20)
    return figure


def _draw_slot(axis: Any, action: Action, start: float, duration: float,
               placement: tuple[int, ...], chunks: int, points_per_unit: float) -> None:
    color = shade(OP_COLORS[action.op.value], chunk_of(placement, action.stage), chunks)
    axis.broken_barh([(start, duration)], (0.08, 0.84), facecolors=color,
                     edgecolors="white", linewidth=0.6)
    label = str(action.microbatch)
    # Shrink the label to the box, and leave tiny boxes unlabelled rather than overprint them.
    size = min(8.0, points_per_unit * duration / (0.62 * len(label) + 0.4))
    if size >= 4.5:
        axis.text(start + duration / 2, 0.5, label, ha="center", va="center",
                  fontsize=size, color=_text_color(color))


def _draw_memory(axis: Any, result: SimResult, rank: int, makespan: float, top: float) -> None:
    points = result.memory[rank]
    times = [float(t) for t, _ in points] + [makespan]
    levels = [float(level) for _, level in points]
    levels.append(levels[-1])
    axis.fill_between(times, levels, step="post", color=MEMORY_COLOR, alpha=0.25, linewidth=0)
    axis.step(times, levels, where="post", color=MEMORY_COLOR, linewidth=0.9)
    axis.set_ylim(0, top * 1.15)
    peak = float(result.peak_memory[rank])
    axis.set_yticks([peak], [f"{peak:g}"], fontsize=7)
    axis.tick_params(axis="y", length=2)
    axis.axhline(peak, color=MEMORY_COLOR, linewidth=0.4, linestyle=":")
    axis.grid(axis="x", linewidth=0.3, alpha=0.5)


def _html_page(result: SimResult, svg: str, source: str = "") -> str:
    svg = svg[svg.index("<svg"):]  # drop the XML prologue and doctype: the SVG sits in HTML
    figures = json.dumps(result.summary(), indent=2)
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(result.name)} pipeline schedule</title>"
        "<style>body{font-family:sans-serif;margin:1em} svg{max-width:100%;height:auto}"
        "pre{background:#f6f6f6;padding:.5em}</style></head><body>\n"
        f"<h2>{html.escape(title_of(result).splitlines()[0])}</h2>\n"
        f"<p>{html.escape(title_of(result, source).splitlines()[1])}</p>\n{svg}\n"
        f"<pre>{html.escape(figures)}</pre>\n</body></html>\n"
    )


# ----------------------------------------------------------------------------------------------
# Chrome / Perfetto trace-event JSON


def trace_event(
    rank: int, action: Action, start_us: float, duration_us: float, chunk: int = 0,
    **args: Any,
) -> dict[str, Any]:
    """One complete ("X") event for ``action`` on ``rank``, in the shared palette.

    Measured runs call this with their own timings so their traces match the simulator's.
    """
    return {
        "name": f"{action.op.value}{action.microbatch}",
        "cat": action.op.value,
        "ph": "X",
        "pid": rank,
        "tid": 0,
        "ts": start_us,
        "dur": duration_us,
        "cname": OP_CNAMES[action.op.value],
        "args": {"action": str(action), "stage": action.stage, "microbatch": action.microbatch,
                 "op": action.op.value, "chunk": chunk, **args},
    }


def rank_metadata(rank: int, label: str = "pipeline rank") -> list[dict[str, Any]]:
    """Name and order the process row of ``rank`` in the trace viewer."""
    return [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"{label} {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}},
    ]


def to_chrome_trace(result: SimResult, us_per_unit: float = 1e6) -> dict[str, Any]:
    """The timeline as trace-event JSON; one time unit is ``us_per_unit`` µs (default: seconds).

    Memory curves become counter ("C") events, drawn by the viewer as a graph under each rank.
    """
    events: list[dict[str, Any]] = []
    for rank, row in enumerate(result.timeline):
        events.extend(rank_metadata(rank, "simulated rank"))
        for slot in row:
            events.append(trace_event(
                rank, slot.action, float(slot.start) * us_per_unit,
                float(slot.duration) * us_per_unit, chunk_of(result.placement, slot.action.stage),
            ))
        for time, level in result.memory[rank]:
            events.append({"name": "activation memory", "ph": "C", "pid": rank,
                           "ts": float(time) * us_per_unit, "args": {"units": float(level)}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": result.summary()}


def write_chrome_trace(result: SimResult, path: str | os.PathLike, us_per_unit: float = 1e6) -> None:
    with open(path, "w") as handle:
        json.dump(to_chrome_trace(result, us_per_unit), handle)
