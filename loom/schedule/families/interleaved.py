"""Interleaved 1F1B: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473 §2.2.2.

Each rank owns v = ``chunks`` stages, looped (stage s on rank s % p). Microbatches advance in
groups ("rounds"): a rank runs chunk 0 of every microbatch of the group, then chunk 1, ... (depth
first), and backwards mirror that with the chunks reversed. Bubble (p-1)/(v·m); peak memory
p·(1 + (p-1)/(p·v)) units on rank 0 when m is a multiple of p (Korthikanti et al. 2022).

Valid for any m >= p. The paper and Megatron need m % p == 0; torch 2.13 uses
``max(1, m // p)`` rounds of equal size and so rejects e.g. p=4, m=9. Loom keeps
``max(1, m // p)`` rounds but lets their sizes differ by one: the remainder m % p goes one
microbatch each to the first rounds (m=9, p=4: rounds of 5 and 4). Every round still has at least
p microbatches, so chunk c+1 of a microbatch never waits for chunk c to travel around the ring,
and whenever torch accepts m the two schedules are identical.
"""

from __future__ import annotations

from loom.schedule.ir import Schedule, looped_placement
from loom.schedule.replay import Row
from loom.schedule.families._common import (check_sizes, looped_work, make_schedule,
                                            microbatch_groups, one_forward_one_backward)


def interleaved_1f1b(pp_size: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B with ``chunks`` stages per rank; valid for m >= p. Uses B."""
    rows = _interleaved_1f1b(pp_size, microbatches, chunks, codes=False)
    return make_schedule("interleaved_1f1b", looped_placement(pp_size, chunks), microbatches, rows)


def interleaved_1f1b_rows(pp_size: int, microbatches: int, chunks: int = 2
                          ) -> tuple[tuple[int, ...], list[Row]]:
    """``interleaved_1f1b``'s placement and its rows as ``loom.schedule.replay.encode`` gives
    them (the search prices seeds from these); the same errors."""
    rows = _interleaved_1f1b(pp_size, microbatches, chunks, codes=True)
    return looped_placement(pp_size, chunks), rows


def _interleaved_1f1b(pp_size: int, microbatches: int, chunks: int, codes: bool) -> list:
    check_sizes("interleaved_1f1b", pp_size, microbatches, min_microbatches=pp_size)
    groups = microbatch_groups(microbatches, pp_size)
    rows = []
    for rank in range(pp_size):
        forwards, backwards = looped_work(rank, pp_size, chunks, groups)
        # The last stage (chunk v-1 on rank p-1) can start backwards once it has run its first
        # forward; each hop towards rank 0 adds one forward and one backward of delay.
        warmup = (chunks - 1) * len(groups[0]) + 2 * (pp_size - 1 - rank)
        rows.append(one_forward_one_backward(forwards, backwards, min(warmup, len(forwards)),
                                             codes=codes))
    return rows
