"""Looped breadth-first pipeline: Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism",
arXiv 2211.05953.

Looped placement with v = ``chunks`` stages per rank. Each rank runs every microbatch through its
first local stage, then its second, ... (breadth first), and the backwards in the opposite order
(last local stage first, microbatches last to first, as torch's ScheduleLoopedBFS). Like GPipe it
keeps all m microbatches alive (peak m units), but it overlaps well with data-parallel
communication. Valid for any m >= 1.
"""

from __future__ import annotations

from loom.schedule.ir import Action, Op, Schedule, looped_placement
from loom.schedule.families._common import check_sizes, make_schedule


def looped_bfs(pp_size: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Looped BFS with ``chunks`` stages per rank; valid for m >= 1. Uses B."""
    check_sizes("looped_bfs", pp_size, microbatches)
    rows = []
    for rank in range(pp_size):
        stages = [chunk * pp_size + rank for chunk in range(chunks)]
        row = [Action(s, Op.F, mb) for s in stages for mb in range(microbatches)]
        row += [Action(s, Op.B, mb) for s in reversed(stages) for mb in reversed(range(microbatches))]
        rows.append(row)
    return make_schedule("looped_bfs", looped_placement(pp_size, chunks), microbatches, rows)
