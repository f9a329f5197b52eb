"""BitPipe's own order: Wu et al. 2024, "BitPipe: Bidirectional Interleaved Pipeline Parallelism
for Accelerating Large Models Training", arXiv 2410.19367, written by construction.

Placement: ``bidirectional_placement`` (``loom.schedule.families.bidirectional``), two V pipelines
in opposite directions over two copies of a 2p-stage model. Route 0 ("down") enters on rank 0
and turns on rank p-1; route 1 ("up") enters on rank p-1 and turns on rank 0; every rank holds
two stages of each route, each half a unit of activations. Full backwards (B), as in the paper,
which does not split them into I and W.

Microbatches come in basic units of p, as in the paper: in unit k (microbatches kp .. kp+p-1)
the first h = p/2 go down and the last h go up (in pairs of halves, not alternating as
``bidirectional_v`` does). So m must be a positive multiple of p (the paper's N = D, 2D, ...;
the authors' implementation refuses other counts) and p even (h microbatches each way, and
mirror ranks r, p-1-r holding one copy each of the same model stages). Below, i is a
microbatch's index among its route's h in the unit and q = 0..2p-1 its position on the route.

Which forwards and which backwards, in which order: read off an ideal timeline in slots (F = 1
slot, B = 2, the paper's 1:2). Forward (i, q) at slot 2i + q: a microbatch crosses its route
without waiting, and each route injects one every other slot, so the two directions interleave
without meeting: on rank r the down microbatches' first leg runs at slots 2i + r and the up
ones' at 2i + p-1-r, whose parities differ because p is even; the second legs (2i + 2p-1-r
down, 2i + p + r up) differ in parity from each other and from their own route's first leg,
and meet the other route's first leg only for i differing by h, which no unit has. So a unit's
2p forwards per rank fit without collision. Backward (i, q) at slot 2p + 2(2i + 2p-1-q): the
forward timeline mirrored (position q -> 2p-1-q, which a V keeps on the same rank) and
stretched by 2, collision-free for the same reason, starting right after the first
microbatch's last forward. Each rank's forwards run in forward-slot order and its backwards in
backward-slot order; units follow one another in both.

How forwards and backwards interleave on rank r (the phases), with d = min(r, p-1-r) the rank's
distance to the nearer end:

* warm-up, W = 3p/2 + d forwards. With the first steady pair's, W + 1 forwards precede the
  first backward: on an end rank exactly those that arrive before its first gradient (the h
  first legs of its own route, both legs of the other route's h, the first turning one); one
  more per hop inward, so the middle ranks (W = 2p-1) hold p units at the peak, 1F1B's, and
  the end ranks 3p/4 + 1/2.
* steady, U = 2p - W pairs (F, B): each remaining forward is followed by a backward, so the
  gradients flowing back never wait more than one forward and memory stays flat.
* cool-down: the unit's remaining backwards.
* direct concatenation (the paper's way to N > D): from the second unit on, once U - 1 of a
  unit's backwards are left, the next unit's warm-up starts, two forwards before each of those
  backwards (a B takes the time of two F), then the rest of its warm-up: the next unit's
  forwards fill the cool-down's idle slots.

Sources and departures. This reproduces the authors' two schedule figures (p = 4, m = 4 and
m = 8, published with their code at github.com/wuhouming/BitPipe) action for action on every
rank (tests/unit/schedule/test_bitpipe.py pins them); the paper's text beyond its abstract was
not available to us, so its formulas are not checked here. The figures show p = 4 only: the
warm-up count for other p follows the authors' implementation (read for its phase counts, not
copied). As we read that implementation, its concatenation starts the next unit one forward
per backward, which at p = 4 departs from its own m = 8 figure and measured slower at p = 4
and 8 (F = 1, B = 2 per stage, m = 4p: 106 and 222 slots against 103 and 219 here): we follow
the figure. Routes come in halves of a unit, not alternating.

Why it matters beside the bubble: a stage's last backward comes well before the step's end, so
the eager copy sum (``loom.pipeline.route_copies``) has 7-13% of the step to hide behind on
average (F = I = W, p <= 8), 2.5-5 times the greedy ``bidirectional_v``'s.

Valid and deadlock-free: the validator replays every even p <= 20 with m <= 8p (the unit test
covers p <= 8, m <= 4p), with a peak of at most p units on every rank. At F = 1, B = 2 per
stage one unit (m = p) idles (p-2)/(4p-2) of the step, which is (p-2)/(3m+p-2) at m = p; each
further unit adds its 6p slots of work and a few idle ones (1, 4, 5, 8 at p = 4, 6, 8, 10), so
the ratio falls more slowly than that formula's with m (docs/design.md, "BitPipe's order").
"""

from __future__ import annotations

from operator import itemgetter

from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.families.bidirectional import bidirectional_placement


def check_bitpipe_sizes(pp_size: int, microbatches: int) -> None:
    """BitPipe's sizes: an even p >= 2 and m a positive multiple of p (units of p/2 each way)."""
    if pp_size < 2 or pp_size % 2:
        raise ValueError(f"bitpipe: pp_size must be even and >= 2 (two V pipelines in opposite"
                         f" directions, p/2 microbatches each way per unit), got {pp_size}")
    if microbatches < pp_size or microbatches % pp_size:
        nearest = max(pp_size, round(microbatches / pp_size) * pp_size)
        raise ValueError(f"bitpipe: needs microbatches a positive multiple of pp_size={pp_size}"
                         f" (the paper's basic unit: p/2 down, p/2 up), got {microbatches}"
                         f" (nearest valid: {nearest})")


def bitpipe(pp_size: int, microbatches: int) -> Schedule:
    """BitPipe's own order on two opposite V pipelines; even p, m a multiple of p. Uses B.

    Two model copies (``Schedule.routes``: each unit of p microbatches sends its first half down
    and its second half up); the order is the paper's, built as the module docstring says."""
    check_bitpipe_sizes(pp_size, microbatches)
    p, half = pp_size, pp_size // 2
    length = 2 * p  # stages per route
    placement = bidirectional_placement(p)
    # per rank: ((unit, slot), action); the slots are distinct within a unit on each rank
    forwards: list[list[tuple[tuple[int, int], Action]]] = [[] for _ in range(p)]
    backwards: list[list[tuple[tuple[int, int], Action]]] = [[] for _ in range(p)]
    for mb in range(microbatches):
        unit, within = divmod(mb, p)
        route, i = divmod(within, half)
        for q in range(length):
            stage = route * length + q
            rank = placement[stage]
            forwards[rank].append(((unit, 2 * i + q), Action(stage, Op.F, mb)))
            backwards[rank].append(((unit, 2 * i + length - 1 - q), Action(stage, Op.B, mb)))
    rows = []
    for rank in range(p):
        fs = iter(action for _, action in sorted(forwards[rank], key=itemgetter(0)))
        bs = iter(action for _, action in sorted(backwards[rank], key=itemgetter(0)))
        rows.append([next(fs) if op is Op.F else next(bs)
                     for op in phases(p, rank, microbatches // p)])
    routes = tuple((mb % p) // half for mb in range(microbatches))
    return Schedule(len(placement), microbatches, placement, rows, name="bitpipe",
                    num_routes=2, routes=routes)


def phases(pp_size: int, rank: int, units: int) -> list[Op]:
    """Rank ``rank``'s sequence of forwards and backwards over ``units`` basic units (module
    docstring): the warm-up of W forwards, U = 2p - W (F, B) pairs, then the cool-down; from
    the second unit on, when U - 1 backwards of a unit are left, the next unit's W warm-up
    forwards start, two before each of those backwards."""
    p = pp_size
    warmup = 3 * p // 2 + min(rank, p - 1 - rank)
    steady = 2 * p - warmup
    ops = [Op.F] * warmup
    for _ in range(units - 1):
        ops += [Op.F, Op.B] * steady + [Op.B] * (2 * p - 2 * steady + 1)
        # the next unit's warm-up: two forwards before each of the U - 1 last backwards (2U - 2
        # < W forwards), then the rest
        ops += [Op.F, Op.F, Op.B] * (steady - 1) + [Op.F] * (warmup - 2 * (steady - 1))
    return ops + [Op.F, Op.B] * steady + [Op.B] * (2 * p - steady)
