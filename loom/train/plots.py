"""Loss-curve PNG from a run's ``metrics.jsonl`` (written by :class:`loom.train.metrics.MetricsLogger`).

The figure is drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas rather than through
``pyplot``: no global backend switch, no figure registry, so it is safe to call from a training
process on a headless node and from tests. The file is written to a temporary name and renamed,
so a reader (or a crash) never sees half a PNG.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loom.files import as_created


def _read_series(metrics_jsonl: Path, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, sorted by step; a step logged twice keeps its last value."""
    by_step: dict[int, float] = {}
    with open(metrics_jsonl, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a torn last line after a crash
                continue
            value = record.get(key)
            if isinstance(value, (int, float)) and "step" in record:
                by_step[int(record["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss_curve(metrics_jsonl: Path | str, out_png: Path | str) -> Path:
    """Plot train ``loss`` per step (and ``val/loss`` points if any) to ``out_png``.

    Raises ValueError if the file holds no loss values at all.
    """
    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    steps, loss = _read_series(metrics_jsonl, "loss")
    val_steps, val_loss = _read_series(metrics_jsonl, "val/loss")
    if not steps and not val_steps:
        raise ValueError(f"plot_loss_curve: no 'loss' or 'val/loss' values in {metrics_jsonl}")

    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if steps:
        # Raw per-step loss is noisy; with many steps show it faint under a moving average.
        window = max(1, len(steps) // 50)
        if window > 1:
            ax.plot(steps, loss, color="tab:blue", alpha=0.3, linewidth=0.8,
                    label="train loss")
            ax.plot(steps, _moving_average(loss, window), color="tab:blue", linewidth=1.6,
                    label=f"train loss (trailing {window}-step mean)")
        else:
            ax.plot(steps, loss, color="tab:blue", linewidth=1.4, marker="." if len(steps) < 30
                    else None, label="train loss")
    if val_steps:
        ax.plot(val_steps, val_loss, color="tab:orange", marker="o", linewidth=1.2,
                label="validation loss")
    ax.set_title(f"Loss — {metrics_jsonl.parent.name or metrics_jsonl.name}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()

    out_png.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out_png.name + ".", suffix=".tmp", dir=out_png.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        as_created(tmp)  # mkstemp made it 0600
        os.replace(tmp, out_png)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out_png
