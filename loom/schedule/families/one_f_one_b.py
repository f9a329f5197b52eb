"""1F1B (PipeDream-Flush): Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", arXiv 2104.04473 §2.2.1 (originally PipeDream-2BW/Flush).

Rank r runs min(p-1-r, m) warm-up forwards, then alternates one forward and one full backward,
then drains the remaining backwards. Same bubble as GPipe, (p-1)/m, but at most p microbatches
in flight: peak memory p units on rank 0 (p-r on rank r). Valid for any m >= 1.
"""

from __future__ import annotations

from loom.schedule.ir import Schedule, looped_placement
from loom.schedule.families._common import check_sizes, make_schedule, one_forward_one_backward


def one_f_one_b(pp_size: int, microbatches: int) -> Schedule:
    """1F1B on p ranks, one stage each; valid for m >= 1. Uses full backwards (B)."""
    check_sizes("1f1b", pp_size, microbatches)
    rows = []
    for rank in range(pp_size):
        work = [(rank, mb) for mb in range(microbatches)]
        warmup = min(pp_size - 1 - rank, microbatches)
        rows.append(one_forward_one_backward(work, work, warmup))
    return make_schedule("1f1b", looped_placement(pp_size), microbatches, rows)
