"""Pipeline schedules as data: the IR, its rules, every family, the search, the replay.

Torch-free and at the ground floor: it imports nothing above itself (and no torch), so the
runtime, the simulator's callers, the visualizer and the planner all consume one schedule IR.

* ``ir``: ``Action``, ``Schedule``, placements, the JSON and torch-CSV formats;
* ``replay``: the one replay engine (integer-coded actions; times, and memory by order) that
  ``validate``, ``simulate`` and the search share;
* ``validate``: the rules and the in-order execution (activation memory per rank);
* ``families``: one generator per schedule family (``schedule_for``);
* ``search`` (with ``search_*``): the schedule search under a memory limit;
* ``cost``: per-stage operation costs (``StageCosts``); ``simulate``: the replay over time
  (``SimResult``: timeline, makespan, bubbles, memory over time);
* ``render``: the Gantt chart and the Chrome / Perfetto trace (matplotlib imported only when
  drawing).
"""

from loom.schedule.ir import (Action, Op, Schedule, explicit_placement, from_torch_rows,
                              looped_placement, v_placement)
from loom.schedule.cost import OpCosts, StageCosts, full_stage_costs, parse_cost_spec
from loom.schedule.simulate import SimResult, Slot, simulate
from loom.schedule.validate import (Execution, ScheduleError, dependencies, execute, format_grid,
                                    memory_profile, peak_memory, validate)

__all__ = ["Action", "dependencies", "execute", "Execution", "explicit_placement", "format_grid",
           "from_torch_rows", "looped_placement", "memory_profile", "Op", "OpCosts",
           "parse_cost_spec", "full_stage_costs", "peak_memory", "Schedule", "ScheduleError",
           "SimResult", "simulate", "Slot", "StageCosts", "v_placement", "validate"]
