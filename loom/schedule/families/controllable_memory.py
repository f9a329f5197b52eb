"""V-Half and V-Min: Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
arXiv 2405.15362.

Both use the V placement (two stages per rank, rank r owns stages r and 2p-1-r) and split the
backward into I and W. The paper builds them by repeating a hand-placed building block whose
lifespan sets the memory: V-Min about 1/3 and V-Half about 1/2 of 1F1B's activation memory
(1F1B holds p units on rank 0), trading some bubble for it.

Loom derives them with its greedy list scheduler (``_greedy.py``) under the paper's memory
budgets, not by transcribing the building blocks: V-Half gets ``p // 2 + 1`` units and V-Min
``ceil(p / 3) + 1`` units per rank (the +1 is the microbatch being worked on). The peak memory
is guaranteed (and tested) to stay within the budget; the order differs from the paper's
figures. Measured at T_F = T_I = T_W, m = 4p, against 1F1B's bubble: V-Half matches the paper
(about half: p=8 gives 23 chunk-steps vs 42), V-Min does worse than the paper's 2/3 (p=8: 51 vs
42; p=16: 141 vs 90), the price of a generic greedy order at such a tight budget; the paper's
building block would do better. Valid for any m >= 1.
"""

from __future__ import annotations

import math

from loom.schedule.ir import Schedule, v_placement
from loom.schedule.families._common import check_sizes
from loom.schedule.families._greedy import greedy_schedule


def v_half_budget(pp_size: int) -> int:
    """Peak activation units per rank that ``v_half`` stays within."""
    return pp_size // 2 + 1


def v_min_budget(pp_size: int) -> int:
    """Peak activation units per rank that ``v_min`` stays within."""
    return math.ceil(pp_size / 3) + 1


def v_half(pp_size: int, microbatches: int) -> Schedule:
    """V-Half on the V placement; valid for m >= 1. Uses I and W."""
    check_sizes("v_half", pp_size, microbatches)
    return greedy_schedule("v_half", v_placement(pp_size, 2), microbatches, v_half_budget(pp_size))


def v_min(pp_size: int, microbatches: int) -> Schedule:
    """V-Min on the V placement; valid for m >= 1. Uses I and W."""
    check_sizes("v_min", pp_size, microbatches)
    return greedy_schedule("v_min", v_placement(pp_size, 2), microbatches, v_min_budget(pp_size))
