"""Handcrafted zero-bubble schedules ZB-H1 and ZB-H2: Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241 §3 (Table 2).

Both split each backward into I (input gradient, on the critical path) and W (weight gradient,
free to move) and use W's to fill the bubbles of 1F1B:

* ZB-H1 keeps 1F1B's in-flight count: rank r delays its W's by r microbatches. Peak memory p
  units on every rank (W ends a microbatch's lifetime); bubble (p-1)(T_F+T_B-T_W), where T_B is
  the input-gradient pass.
* ZB-H2 adds forwards to the warm-up (2(p-1-r) instead of p-1-r) and delays W's by 2r, so each
  rank runs without a gap from its first F to its last W when T_F = T_B = T_W: bubble
  (p-1)(T_F+T_B-2T_W); peak memory 2p-1 units.

Valid for any m >= 1 (warm-ups are capped at m; small m simply leaves bubbles).

``interleaved_zb`` is ZB-H1 over v = ``chunks`` looped stages per rank, the order torch 2.13's
``ScheduleInterleavedZeroBubble`` ships (its docstring calls it ZB1P): the forwards and the input
gradients walk the chunks in rounds of microbatches as interleaved 1F1B does
(``loom.schedule.families.interleaved``), the warm-up is one forward per hop instead of two
((v-1) x round + p-1-r forwards on rank r, as the I's arrive one hop apart), and rank r delays
each W by r input gradients, as ZB-H1 does. With one chunk it is exactly ZB-H1. Valid for any
m >= 1; rounds follow ``microbatch_groups`` (torch's when m is a multiple of their count, which is
the only case torch accepts). It is not in the family registry: the schedule search seeds itself
with it (torch's schedules are its baselines), and registering it would ask the runtime's and the
torch-interop suites to cover a new name.
"""

from __future__ import annotations

from loom.schedule.ir import Schedule, looped_placement
from loom.schedule.replay import Row
from loom.schedule.families._common import (check_sizes, looped_work, make_schedule,
                                            microbatch_groups, one_forward_one_backward)


def _handcrafted(name: str, pp_size: int, microbatches: int, depth: int) -> Schedule:
    # depth 1: ZB-H1, depth 2: ZB-H2 (warm-up and W delay both scale with it)
    check_sizes(name, pp_size, microbatches)
    rows = []
    for rank in range(pp_size):
        work = [(rank, mb) for mb in range(microbatches)]
        warmup = min(depth * (pp_size - 1 - rank), microbatches)
        rows.append(
            one_forward_one_backward(
                work, work, warmup, split_backward=True, weight_delay=depth * rank
            )
        )
    return make_schedule(name, looped_placement(pp_size), microbatches, rows)


def zb_h1(pp_size: int, microbatches: int) -> Schedule:
    """ZB-H1 on p ranks, one stage each; valid for m >= 1. Uses I and W."""
    return _handcrafted("zb_h1", pp_size, microbatches, depth=1)


def zb_h2(pp_size: int, microbatches: int) -> Schedule:
    """ZB-H2 on p ranks, one stage each; valid for m >= 1. Uses I and W."""
    return _handcrafted("zb_h2", pp_size, microbatches, depth=2)


def interleaved_zb(pp_size: int, microbatches: int, chunks: int = 2) -> Schedule:
    """torch's interleaved zero bubble (ZB-H1 over ``chunks`` looped stages per rank); valid for
    m >= 1. Uses I and W."""
    rows = _interleaved_zb(pp_size, microbatches, chunks, codes=False)
    name = "interleaved_zb" if chunks > 1 else "zb_h1"
    return make_schedule(name, looped_placement(pp_size, chunks), microbatches, rows)


def interleaved_zb_rows(pp_size: int, microbatches: int, chunks: int = 2
                        ) -> tuple[tuple[int, ...], list[Row]]:
    """``interleaved_zb``'s placement and its rows as ``loom.schedule.replay.encode`` gives them
    (the search prices the full-size seeds from these and builds the ``Action``'s of the winner
    only); the same errors."""
    rows = _interleaved_zb(pp_size, microbatches, chunks, codes=True)
    return looped_placement(pp_size, chunks), rows


def _interleaved_zb(pp_size: int, microbatches: int, chunks: int, codes: bool) -> list:
    check_sizes("interleaved_zb", pp_size, microbatches)
    if chunks < 1:
        raise ValueError(f"interleaved_zb: chunks must be >= 1, got {chunks}")
    groups = microbatch_groups(microbatches, pp_size)
    rows = []
    for rank in range(pp_size):
        forwards, backwards = looped_work(rank, pp_size, chunks, groups)
        warmup = (chunks - 1) * len(groups[0]) + pp_size - 1 - rank
        rows.append(one_forward_one_backward(forwards, backwards, min(warmup, len(forwards)),
                                             split_backward=True, weight_delay=rank, codes=codes))
    return rows
