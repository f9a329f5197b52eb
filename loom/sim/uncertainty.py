"""The planner's uncertainty band: how far a predicted step time may be from the real one.

A prediction is a point; how far to trust it is measured, not assumed. Two sources:

* **The model's known error**, on the "tune" half of ``bench/planner_published.toml`` (the half
  the planner may be fitted to; issue 21): Loom's predicted step time over the published one
  has a 10th percentile of ``TUNE_RATIO_LOW`` and a 90th of ``TUNE_RATIO_HIGH`` over the 18
  comparable tune rows, each priced with its own framework profile. A real step of a
  prediction t is then, 8 times in 10 on that evidence, between t / TUNE_RATIO_HIGH and
  t / TUNE_RATIO_LOW. Measured 29 Nov 2026 (after a flash kernel's backward was priced at
  2.5 times its forward and Transformer Engine's SM margin beside its TP communication) with
  ``python bench/planner_published.py --no-search --json out.json``: its ``split_report``
  gives the tune half's ``ratio_p10_p90`` (``statistics.quantiles``, n = 10, inclusive) and
  how many holdout rows lie inside it, 42 of 83 (without the hardware spread below;
  tests/unit/plan/test_published_split.py holds the constants to the bench). Earlier: 0.844
  and 1.077 (29 Nov, with the flash backward alone), 0.833 and 1.076 (29 Nov, before it),
  0.885 and 1.157 (26 Nov, from 15 tune rows).
* **The calibration's spread**, for a measured (CPU) profile (``Gpu.cores`` > 0): repeated
  calibrations of this machine moved a layout's prediction by up to 29% (docs/planner.md, runs 5
  and 6: dp4 0.794 s against 0.617 s), so the band widens by ``CALIBRATION_SPREAD`` each way.

* **The accelerator's uncertain clock**, for a power-capped part (``Gpu.power_fraction_range``,
  e.g. the H100 at 500 W): the sustained fraction of peak is an estimate known only within a
  range, so the band widens by ``Gpu.step_spread`` (the step times that range implies, over
  the predicted one).

``band`` gives (low, high) around a step time; ``overlapping`` how many of the best-ranked
steps lie within the first one's band (the ranking among them is not resolved by the model).
Torch-free, communicates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

TUNE_RATIO_LOW = 0.854  # 10th percentile of predicted / published step time, tune half
TUNE_RATIO_HIGH = 1.077  # 90th percentile
CALIBRATION_SPREAD = 0.29  # run-to-run movement of a CPU calibration's predictions


def band(step: float, calibrated: bool = False,
         hardware: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float]:
    """(low, high) seconds around a predicted ``step``: the tune half's 10th-90th percentile
    error, widened by the calibration's spread for a ``calibrated`` (measured CPU) profile and
    by the accelerator's ``hardware`` spread (``Gpu.step_spread``: the real step over the
    predicted one that its uncertain clock allows, low <= 1 <= high). Always contains ``step``."""
    if not hardware[0] <= 1 <= hardware[1]:
        raise ValueError(f"hardware spread {hardware} must be (low <= 1, high >= 1)")
    low, high = step / TUNE_RATIO_HIGH * hardware[0], step / TUNE_RATIO_LOW * hardware[1]
    if calibrated:
        low, high = low / (1 + CALIBRATION_SPREAD), high * (1 + CALIBRATION_SPREAD)
    return min(low, step), max(high, step)


def overlapping(steps: Sequence[float], calibrated: bool = False,
                hardware: tuple[float, float] = (1.0, 1.0)) -> int:
    """How many of ``steps`` (ranked, fastest first) could be at least as fast as the first
    one: those whose band's low end is below the first one's high end (1 when the first
    stands alone)."""
    if not steps:
        return 0
    top_high = band(steps[0], calibrated, hardware)[1]
    return sum(1 for s in steps if band(s, calibrated, hardware)[0] <= top_high)


__all__ = ["band", "overlapping", "TUNE_RATIO_LOW", "TUNE_RATIO_HIGH", "CALIBRATION_SPREAD"]
