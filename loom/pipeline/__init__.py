"""Pipeline parallelism: the schedule IR, its validator and the schedule generators.

``ir`` holds the data (``Action``, ``Schedule``, placements, JSON and torch-CSV formats),
``validate`` the rules and the in-order execution, ``schedules`` one generator per family.
"""

from loom.pipeline.ir import (
    Action,
    Op,
    Schedule,
    explicit_placement,
    from_torch_rows,
    looped_placement,
    v_placement,
)
from loom.pipeline.validate import (
    Execution,
    ScheduleError,
    dependencies,
    execute,
    format_grid,
    memory_profile,
    peak_memory,
    validate,
)

__all__ = [
    "Action",
    "Execution",
    "Op",
    "Schedule",
    "ScheduleError",
    "dependencies",
    "execute",
    "explicit_placement",
    "format_grid",
    "from_torch_rows",
    "looped_placement",
    "memory_profile",
    "peak_memory",
    "v_placement",
    "validate",
]
