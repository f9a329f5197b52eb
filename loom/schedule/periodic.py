"""Periodic extension: a schedule for m microbatches grown from one for fewer.

A pipeline schedule has a warm-up, a steady state and a cool-down. In the steady state every
rank repeats one pattern of (stage, op) pairs, each pair the same number of times (Delta
microbatches per period). ``extend`` finds on every rank the window nearest the middle of its
row that holds Delta of each of the rank's (stage, op) pairs (in a steady state, one period),
the same Delta on all ranks, inserts ``(target - microbatches) / Delta`` more copies of it, and
numbers each (stage, op)'s microbatches first-in first-out again. The result has the small
schedule's warm-up and cool-down around a longer steady state. Over such a window the live
memory returns to where it started (as many F's as last backward pieces of each stage), so the
peak is the small schedule's. The families' orders grow into exactly their own orders for more
microbatches (1F1B, ZB-H1/H2, ZB-V, interleaved 1F1B and zero bubble: tested).

What it is for: the schedule search (``loom.schedule.search``) explores on a copy of a large
problem with fewer microbatches and grows its best orders to full size here, at the cost of a
list copy instead of a full-size run of the list schedulers. Whether the grown order is good or
even runs is the replay's to say (``loom.schedule.replay``): the search replays it at full size
and drops it on a stall. A row whose pairs do not run their microbatches in order, or ranks
without such a window, give None; the list schedulers' orders on a copy of 3p-4p microbatches
mostly have none (their warm-up fills the memory limit and their W's fall ever further behind),
and the search then builds the order again at full size.

Why hand-written: it works on the replay's integer rows; no library knows them. Plain lists and
C-level passes (``map``, ``operator.eq``) keep it to a fraction of one replay.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

from loom.schedule.replay import Row

MAX_DELTA = 64  # the longest period tried, in microbatches per (stage, op)


def in_order(rows: Sequence[Row], microbatches: int) -> bool:
    """Every (stage, op) of every rank runs microbatches 0, 1, ..., microbatches - 1 in that order
    (first-in first-out): the numbering ``extend`` restores after growing the rows."""
    for row in rows:
        seen: dict[tuple[int, int], int] = {}
        for s, o, k in row:
            if seen.get((s, o), 0) != k:
                return False
            seen[s, o] = k + 1
        if any(n != microbatches for n in seen.values()):
            return False
    return True


def _balance_keys(pattern: list[int]) -> tuple[list[int], int]:
    """Per position i of ``pattern``, an int that is equal at i and j exactly when the window
    [i, j) holds each of the row's (stage, op) kinds equally often; and the number of kinds.

    The key packs the differences of the running counts of kinds 0..K-2 from kind K-1, 20 bits
    each (digits of -2**19..2**19: exact for rows of under 2**19 of any kind), built by one C-level
    ``accumulate`` over per-kind weights whose sum is 0."""
    kinds = sorted(set(pattern))
    weight = {kind: 1 << (20 * n) for n, kind in enumerate(kinds[:-1])}
    weight[kinds[-1]] = -sum(weight.values())
    return [0, *itertools.accumulate(map(weight.__getitem__, pattern))], len(kinds)


def _window(keys: list[int], kinds: int, delta: int) -> int | None:
    """The start of a window of length ``delta * kinds`` that holds ``delta`` of each kind,
    the one nearest the middle of the row (in its steady state, away from the warm-up and the
    cool-down); None when there is none."""
    length = delta * kinds
    size = len(keys) - 1
    if length > size:
        return None
    balanced = [at for at, same in enumerate(map(operator.eq, keys, keys[length:])) if same]
    if not balanced:
        return None
    middle = (size - length) / 2
    return min(balanced, key=lambda at: (abs(at - middle), at))


def extend(rows: Sequence[Row], microbatches: int, target: int) -> list[Row] | None:
    """``rows`` (a complete schedule for ``microbatches``) grown to ``target`` microbatches by
    repeating each rank's steady-state period, microbatches renumbered in order per (stage, op);
    None when the rows are not in order (``in_order``) or no Delta up to ``MAX_DELTA`` dividing
    ``target - microbatches`` gives every rank a period."""
    if target == microbatches:
        return [list(row) for row in rows]
    if target < microbatches or not in_order(rows, microbatches):
        return None
    extra = target - microbatches
    keyed = [_balance_keys([s * 8 + o for s, o, _ in row]) if row else ([0], 1)
             for row in rows]  # op codes are below 8
    kinds = [count for _, count in keyed]
    for delta in range(1, min(MAX_DELTA, microbatches) + 1):
        if extra % delta:
            continue
        windows = []
        for keys, count in keyed:
            at = _window(keys, count, delta) if len(keys) > 1 else 0
            if at is None:
                break
            windows.append(at)
        else:
            return [_grown(row, at, delta * count, extra // delta)
                    for row, at, count in zip(rows, windows, kinds)]
    return None


def _grown(row: Row, at: int, length: int, copies: int) -> Row:
    """``row`` with ``copies`` more of its window ``[at, at + length)``, renumbered in order."""
    if not row:
        return []
    pairs = [(s, o) for s, o, _ in row]
    grown = pairs[:at + length] + pairs[at:at + length] * copies + pairs[at + length:]
    following: dict[tuple[int, int], int] = {}
    out = []
    for pair in grown:
        k = following.get(pair, 0)
        following[pair] = k + 1
        out.append((pair[0], pair[1], k))
    return out
