"""GPipe: all forwards, then all backwards (Huang et al. 2019, "GPipe", arXiv 1811.06965).

Bubble fraction (p-1)/m (Narayanan et al. 2021 §2.2); every rank holds all m microbatches'
activations, so the peak is m units. Valid for any microbatch count m >= 1.
"""

from __future__ import annotations

from loom.schedule.ir import Action, Op, Schedule, looped_placement
from loom.schedule.families._common import check_sizes, make_schedule


def gpipe(pp_size: int, microbatches: int) -> Schedule:
    """GPipe on p ranks, one stage each; valid for m >= 1. Uses full backwards (B)."""
    check_sizes("gpipe", pp_size, microbatches)
    rows = [
        [Action(rank, Op.F, mb) for mb in range(microbatches)]
        + [Action(rank, Op.B, mb) for mb in range(microbatches)]
        for rank in range(pp_size)
    ]
    return make_schedule("gpipe", looped_placement(pp_size), microbatches, rows)
