"""``metrics.profile_steps = [A, B]``: a torch.profiler trace of training steps A to B.

Every rank traces the same steps (a slow collective is only understood with both of its sides)
and writes one Chrome trace, ``run_dir/profile/rank<r>.json``, loadable in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``. Each traced step is one ``loom step <n>`` range, and
on a GPU the trace holds the kernels too.

The profiler is started and stopped by hand around the steps rather than by ``torch.profiler``'s
``schedule``: the schedule counts its own ``step()`` calls from 0, while a resumed run starts at
its checkpoint's step; here the trainer names the step it is about to run, so a run resumed inside
A..B traces the steps of the range it still has, and one resumed past B traces nothing. The range
is inclusive, one number meaning one step (``loom.config_rules`` checks 1 <= A <= B <=
train.steps). The traced steps run slower (the profiler's own overhead): their step_time_s and
MFU are not representative.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    """Traces steps ``first..last`` (``steps``: ``()``, ``(A,)`` or ``(A, B)``) of one rank.

    Call :meth:`begin` before and :meth:`end` after each training step; use it as a context
    manager so that a loop that stops early (preemption) still writes the steps it traced, and
    one that fails stops the profiler without writing a half-true trace.
    """

    def __init__(self, steps: tuple[int, ...], run_dir: Path | None, rank: int,
                 device: torch.device, log: Callable[[str], None] = print) -> None:
        self.first, self.last = (steps[0], steps[-1]) if steps else (0, -1)
        self.path = (run_dir / "profile" / f"rank{rank}.json"
                     if steps and run_dir is not None else None)
        self.device = device
        self.log = log
        self.written: Path | None = None
        self._prof: profile | None = None
        self._range: Any = None
        self._traced: list[int] = []

    def begin(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run: start tracing if it is in the range."""
        if self.path is None or not self.first <= step <= self.last:
            return
        if self._prof is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.start()
        self._range = record_function(f"loom step {step}")
        self._range.__enter__()
        self._traced.append(step)

    def end(self, step: int) -> None:
        """Step ``step`` has run: close its range; after the last one, write the trace."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and step >= self.last:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")  # a reader never sees half a trace
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, self.path)
        self.written = self.path
        first, last = self._traced[0], self._traced[-1]
        self.log(f"profile: steps {first}-{last} traced to"
                 f" {self.path.parent}/rank<r>.json (one Chrome trace per rank)")

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is None:
            return
        if exc_type is None:  # stopped early inside the range (preempted): what was traced
            self._finish()
        else:
            prof, self._prof = self._prof, None
            prof.stop()


__all__ = ["StepProfiler"]
