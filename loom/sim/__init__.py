"""Offline pipeline simulation: replay any schedule with per-stage costs, without accelerators.

``cost`` holds the pipeline costs (``StageCosts``), ``simulate`` the replay (``simulate`` ->
``SimResult``: timeline, makespan, bubbles, memory over time), ``render`` the Gantt chart and the
Chrome / Perfetto trace (imported lazily: it needs matplotlib only when drawing).
"""

from loom.sim.cost import OpCosts, StageCosts, parse_cost_spec
from loom.sim.simulate import SimResult, Slot, simulate

__all__ = ["OpCosts", "SimResult", "Slot", "StageCosts", "parse_cost_spec", "simulate"]
