"""Per-step training metrics: timing, throughput, MFU, peak memory, and where they are written.

Three sinks, plus any experiment tracker (``loom.train.trackers``), all owned by
:class:`MetricsLogger` on the main rank only (every other rank gets a logger whose methods do
nothing, so the training loop calls it unconditionally):

* ``run_dir/metrics.jsonl``: one JSON object per call, flushed at once so a crash loses nothing;
  it is the source of truth (plots, experiment logs and tests read it).
* ``run_dir/tb/``: TensorBoard event files, if tensorboard is installed (optional, imported
  lazily; missing means one warning, not a failure).
* the terminal: a tqdm bar on stderr, or one plain line every ``log_every`` steps when stderr is
  not a TTY (CI logs, ``nohup``), where a bar's carriage returns would be garbage. Both show an
  ETA: the remaining steps times a smoothed wall time per step (:class:`StepPace`).

Conventional metric keys (the bar and plots look for these; any other key is logged as is):
``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``mfu`` (fraction, not percent),
``step_time_s``, ``peak_mem_bytes``; evaluation metrics get the prefix ``val/``.

MFU is honest or absent: ``None`` (JSON null, shown "n/a") when no peak is stated
(``loom.train.flops``), and never above 1: a model cannot do more FLOPs than the device's peak,
so a figure above 100% means the stated peak is wrong. The logger then records null, shows
"n/a (peak too low)" and warns once, instead of publishing an impossible number.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, TextIO

import torch

from loom.train.flops import synchronize

_TB_WARNED = False


@dataclass(frozen=True)
class StepTiming:
    """Wall time and derived throughput of one step."""

    step_time_s: float
    tokens_per_s: float
    mfu: float | None  # None: no stated peak

    def as_dict(self) -> dict[str, float | None]:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu}


class StepTimer:
    """Times steps and turns tokens per step into tokens/s and MFU.

        tokens_per_s = tokens / step_time_s
        MFU          = flops_per_token · tokens_per_s / (peak_flops · n_devices)

    ``flops_per_token`` is the model FLOPs of one trained token
    (:func:`loom.formulas.flops.training_flops_per_token`), ``peak_flops`` the peak of *one* device
    (:func:`loom.train.flops.device_peak_flops`), None when none is stated: MFU is then None.
    Pass the *global* token count of the step (all data-parallel replicas) with ``n_devices`` =
    world size; or the local count with the number of devices that share it; both give the same
    MFU. Each process measures its own clock, so on accelerators :meth:`start` and :meth:`stop`
    synchronize the device first.
    """

    def __init__(self, *, flops_per_token: float, peak_flops: float | None, n_devices: int = 1,
                 device: torch.device | str = "cpu") -> None:
        if (peak_flops is not None and peak_flops <= 0) or n_devices <= 0:
            raise ValueError(f"StepTimer: peak_flops={peak_flops} and n_devices={n_devices} "
                             "must be positive")
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.n_devices = n_devices
        self.device = torch.device(device)
        self._t0: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> StepTiming:
        """End the step begun by :meth:`start`; ``tokens`` were trained in it."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() called without start()")
        synchronize(self.device)
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self._t0 = None
        tps = tokens / dt
        return StepTiming(dt, tps, self.mfu(tps))

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.peak_flops is None:
            return None
        return self.flops_per_token * tokens_per_s / (self.peak_flops * self.n_devices)


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process on ``device`` since start or the last reset, in bytes.

    CUDA (and other backends with the same API, e.g. XPU): the caching allocator's
    ``max_memory_allocated``, i.e. live tensor bytes. CPU: the process's maximum resident set size
    from ``resource.getrusage``, an *upper bound* on tensor memory (it includes the interpreter,
    libraries and allocator slack, and it cannot be reset); 0 where ``resource`` is unavailable.
    """
    device = torch.device(device)
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        fn = getattr(backend, "max_memory_allocated", None)
        return int(fn(device)) if fn is not None else 0
    try:
        import resource
    except ImportError:  # Windows
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS bytes, Linux KiB


def _clean(value: Any) -> float | int | str | None:
    """A JSON-safe scalar: 0-d tensors become numbers, NaN/inf become null (strict JSON), None
    (a value that does not exist, e.g. MFU without a stated peak) stays null."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if value is None or isinstance(value, bool) or isinstance(value, (int, str)):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


def format_eta(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``, ``3d04h``: a remaining time, as precise as is useful."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


class StepPace:
    """Smoothed wall time per step, from the times steps are logged, for the ETA.

    An exponential moving average (weight ``alpha`` for the newest interval): the occasional slow
    step (an evaluation, a checkpoint) counts in proportion instead of throwing the ETA around.
    Wall time between logged steps, not ``step_time_s``: what is left to wait includes the
    evaluations and checkpoints. The first logged step only starts the clock, since the time
    before it is start-up (building the model, the first kernels) that no later step repeats.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.seconds_per_step: float | None = None
        self._last: tuple[int, float] | None = None

    def update(self, step: int, now: float) -> None:
        """Step ``step`` was logged at time ``now`` (seconds, any monotonic clock)."""
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
            previous = self.seconds_per_step
            self.seconds_per_step = per_step if previous is None else (
                self.alpha * per_step + (1 - self.alpha) * previous)
        if self._last is None or step > self._last[0]:
            self._last = (step, now)

    def eta(self, remaining_steps: int) -> float | None:
        """Seconds until ``remaining_steps`` more steps are done; None before two steps."""
        if self.seconds_per_step is None:
            return None
        return max(0, remaining_steps) * self.seconds_per_step


class Tracker(Protocol):
    """An experiment tracker (``loom.train.trackers``): gets the scalars TensorBoard gets."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _fmt(key: str, value: float | int | str | None) -> str:
    if value is None and key.endswith("mfu"):
        return f"{key} n/a"
    if value is None or isinstance(value, str):
        return f"{key} {value}"
    if key.endswith("mfu"):
        return f"{key} {100 * value:.1f}%"
    if key.endswith("tokens_per_s"):
        return f"tok/s {value:,.0f}"
    if key.endswith("peak_mem_bytes"):
        return f"mem {value / 2**30:.2f}GiB"
    if isinstance(value, int):
        return f"{key} {value}"
    return f"{key} {value:.4g}"


class MetricsLogger:
    """Writes step and eval metrics to JSONL, TensorBoard and the terminal (main rank only).

    Every :meth:`log_step` / :meth:`log_eval` call goes to JSONL, TensorBoard and the
    ``trackers``; the terminal shows every step on a TTY bar and every ``log_every``-th step as a
    plain line otherwise. ``peak_flops`` (per device; None: none stated) is only for the
    warning when MFU comes out above 100%.
    """

    def __init__(self, run_dir: Path | str | None, *, is_main: bool, jsonl: bool = True,
                 tensorboard: bool = True, progress: bool = True, total_steps: int,
                 log_every: int = 1, stream: TextIO | None = None,
                 trackers: Sequence[Tracker] = (), peak_flops: float | None = None) -> None:
        self.active = is_main
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self._stream = stream if stream is not None else sys.stderr
        self._jsonl: TextIO | None = None
        self._tb: Any = None
        self._bar: Any = None
        self._progress = progress
        self._t_start = time.time()
        self._pace = StepPace()
        self._peak_flops = peak_flops
        self._peak_too_low = False  # MFU came out above 100% once: the stated peak is wrong
        self._trackers = list(trackers) if self.active else []
        if not self.active:
            return
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if jsonl:
                # Append: a resumed run continues the same file (plots keep the last value of
                # a step that was logged twice).
                self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
            if tensorboard:
                self._tb = _open_tensorboard(self.run_dir / "tb")
        if progress and self._stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, file=self._stream, dynamic_ncols=True,
                             unit="step")

    @property
    def metrics_path(self) -> Path | None:
        return self.run_dir / "metrics.jsonl" if self.run_dir is not None else None

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the training metrics of ``step`` (e.g. loss, grad_norm, lr, tokens_per_s, mfu)."""
        if not self.active:
            return
        clean = {k: _clean(v) for k, v in metrics.items()}
        self._honest_mfu(clean)
        self._write(step, clean, tb_prefix="train/")
        self._pace.update(step, time.monotonic())
        eta = self._pace.eta(self.total_steps - step) if step < self.total_steps else None
        shown_eta = [f"eta {format_eta(eta)}"] if eta is not None else []
        if self._bar is not None:
            self._bar.update(max(0, step - self._bar.n))
            shown = [self._show(k, clean[k]) for k in ("loss", "tokens_per_s", "mfu")
                     if k in clean]
            self._bar.set_postfix_str(" | ".join(shown + shown_eta), refresh=False)
        elif self._progress and (step % self.log_every == 0 or step == self.total_steps):
            # Per-axis communication counters go to JSONL/TensorBoard only: too many for a line.
            body = [self._show(k, v) for k, v in clean.items() if not k.startswith("comm/")]
            self._print(f"step {step}/{self.total_steps} | " + " | ".join(body + shown_eta))

    def _honest_mfu(self, clean: dict[str, Any]) -> None:
        """Null an MFU above 100%, and every later one: the peak it was computed against is too
        low, so no figure against it is right. Warn once."""
        mfu = clean.get("mfu")
        if not isinstance(mfu, (int, float)) or isinstance(mfu, bool):
            return
        if mfu > 1 and not self._peak_too_low:
            self._peak_too_low = True
            against = (f"the stated peak of {self._peak_flops / 1e12:,.4g} TFLOP/s per device"
                       if self._peak_flops else "the stated peak")
            self._print(f"warning: MFU came out at {100 * mfu:,.0f}% against {against}; a model"
                        " cannot beat its device's peak, so the peak is too low: MFU is logged"
                        " as n/a from here on. Set --metrics.peak_tflops to the device's dense"
                        " peak.")
        if self._peak_too_low:
            clean["mfu"] = None

    def _show(self, key: str, value: Any) -> str:
        if key == "mfu" and value is None and self._peak_too_low:
            return "mfu n/a (peak too low)"
        return _fmt(key, value)

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """Record evaluation metrics at ``step``; keys are stored as ``val/<key>``."""
        if not self.active:
            return
        clean = {f"val/{k}": _clean(v) for k, v in metrics.items()}
        self._write(step, clean, tb_prefix="")
        if self._progress:
            self._print(f"eval step {step} | " + " | ".join(_fmt(k, v) for k, v in clean.items()))

    def log_text(self, msg: str) -> None:
        """Print a message on the terminal without breaking the progress bar."""
        if self.active:
            self._print(msg)

    def close(self, *, plot: bool = True) -> Path | None:
        """Flush and close every sink; with ``plot``, write ``run_dir/loss_curve.png``.

        Returns the PNG path, or None when nothing was plotted.
        """
        if not self.active:
            return None
        self.active = False  # idempotent: a second close (e.g. in a finally) does nothing
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        if self._jsonl is not None:
            self._jsonl.close()
        path = self.metrics_path
        if plot and self._jsonl is not None and path is not None and path.stat().st_size > 0:
            from loom.train.plots import plot_loss_curve  # matplotlib: 0.6 s, at the end only

            try:
                return plot_loss_curve(path, path.with_name("loss_curve.png"))
            except ValueError:  # no loss values were logged; nothing to draw
                return None
        return None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, step: int, clean: dict[str, Any], *, tb_prefix: str) -> None:
        if self._jsonl is not None:
            record = {"step": step, "time": round(time.time() - self._t_start, 3), **clean}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        scalars = {(key if "/" in key else tb_prefix + key): value for key, value in clean.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
            # No flush per step: the writer flushes on its own timer and at close, and the JSONL
            # file above is the crash-safe record.
        for tracker in self._trackers:  # the same scalars under the same tags
            tracker.log(scalars, step)

    def _print(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg, file=self._stream)
        else:
            print(msg, file=self._stream, flush=True)


def _open_tensorboard(log_dir: Path) -> Any:
    """A SummaryWriter, or None (with one warning per process) if tensorboard is missing."""
    global _TB_WARNED
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # tensorboard is an optional dependency
        if not _TB_WARNED:
            warnings.warn(f"TensorBoard logging disabled: {err}", stacklevel=3)
            _TB_WARNED = True
        return None
    return SummaryWriter(log_dir=str(log_dir))
