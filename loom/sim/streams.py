"""One rank's streams as a small event model: compute, and one queue per link class.

The cost model used to hide each overlapped collective behind compute on its own ("exposed =
max(0, collective - compute)"), so two collectives sharing one link (ZeRO-3's parameter
all-gather and its gradient reduce-scatter in the same backward, say) were each hidden in full
although the link can carry only one at a time. Here the rank has a ``compute`` stream and one
stream per link class it talks over (``intra`` / ``inter``, or any name); every operation runs
on one stream, in the order it was issued on that stream (a FIFO, as NCCL's one communicator
per stream does), and starts once its stream is free and the operations it depends on are done.
Two collectives on one link therefore take the sum of their times, on two links the max.

``run`` places a list of ``Op`` and returns their end times. ``layer_overlap`` builds the
pattern the cost model needs over and over: n equal compute slices (the layers of a pass),
with per-layer collective pieces that either follow their slice (a gradient reduce-scatter,
issued once the layer's backward is done) or precede it (a parameter all-gather, prefetched
``ahead`` slices early, which must land before the slice starts), and optional idle ``slack``
after the compute in which the links may still drain (the pipeline flush). Its answer is the
exposed time: the end of everything minus the compute. Layers are uniform, so past a short
warm-up every slice adds the same time: ``layer_overlap`` simulates at most ``EXACT_LAYERS``
slices and extends the last slice's increment over the rest (checked against the full event
run in tests/unit/plan/test_streams.py). Torch-free, communicates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EXACT_LAYERS = 8  # slices simulated event by event; the rest extend the steady state


@dataclass(frozen=True)
class Op:
    """One operation on one stream: ``seconds`` long, after the ops at indices ``after``."""

    stream: str
    seconds: float
    after: tuple[int, ...] = ()


def run(ops: Sequence[Op]) -> list[float]:
    """End time of every op: each starts when its stream has finished the ops issued on it
    before and every op it depends on has ended (dependencies must point to earlier ops)."""
    free: dict[str, float] = {}
    ends: list[float] = []
    for k, op in enumerate(ops):
        if any(d >= k for d in op.after):
            raise ValueError(f"op {k} depends on a later op {op.after}")
        start = max([free.get(op.stream, 0.0)] + [ends[d] for d in op.after])
        end = start + op.seconds
        free[op.stream] = end
        ends.append(end)
    return ends


@dataclass(frozen=True)
class Pieces:
    """A collective cut into one piece per layer slice: ``seconds`` each on ``stream``;
    ``before`` pieces must land before their slice starts (prefetched ``ahead`` slices early),
    the others are issued when their slice ends."""

    stream: str
    seconds: float
    before: bool = False
    ahead: int = 1


def _events(layers: int, compute: float, pieces: Sequence[Pieces]) -> tuple[float, float]:
    """The event run of ``layer_overlap``'s pattern over ``layers`` slices: (the end of the
    compute, the end of every link)."""
    ops: list[Op] = []
    slice_op: list[int] = []  # index of each compute slice
    before = [p for p in pieces if p.before]
    after = [p for p in pieces if not p.before]
    landed: dict[tuple[int, int], int] = {}  # (piece kind, layer) -> op index of a gather
    for k, p in enumerate(before):  # the prefetch window's first gathers, issued at once
        for layer in range(min(p.ahead, layers)):
            landed[(k, layer)] = len(ops)
            ops.append(Op(p.stream, p.seconds))
    for layer in range(layers):
        deps = tuple(landed[(k, layer)] for k in range(len(before)))
        if slice_op:
            deps += (slice_op[-1],)
        slice_op.append(len(ops))
        ops.append(Op("compute", compute, deps))
        for k, p in enumerate(before):  # the gather `ahead` layers on, issued as this starts
            nxt = layer + p.ahead
            if nxt < layers:
                landed[(k, nxt)] = len(ops)
                ops.append(Op(p.stream, p.seconds, (slice_op[-2],) if len(slice_op) > 1 else ()))
        for p in after:
            ops.append(Op(p.stream, p.seconds, (slice_op[-1],)))
    ends = run(ops)
    compute_end = ends[slice_op[-1]] if slice_op else 0.0
    return compute_end, max(ends)


def layer_overlap(layers: int, compute: float, pieces: Sequence[Pieces],
                  slack: float = 0.0) -> float:
    """Exposed seconds of ``pieces`` behind ``layers`` compute slices of ``compute`` seconds
    each, with ``slack`` idle seconds after the compute in which the links may still drain:
    the compute's own delay (slices waiting for their gathers) or the links' excess past the
    slack, whichever is larger (0 when every piece hides)."""
    pieces = [p for p in pieces if p.seconds > 0]
    if layers < 1 or not pieces:
        return 0.0
    if layers <= EXACT_LAYERS:
        compute_end, link_end = _events(layers, compute, pieces)
    else:  # uniform slices: the last simulated slice's increments repeat
        k = EXACT_LAYERS
        c1, l1 = _events(k, compute, pieces)
        c0, l0 = _events(k - 1, compute, pieces)
        compute_end = c1 + (layers - k) * (c1 - c0)
        link_end = l1 + (layers - k) * (l1 - l0)
    busy = layers * compute
    return max(0.0, compute_end - busy, link_end - busy - slack)


def chunked_overlap(compute: float, comm: float, chunks: int) -> float:
    """Seconds of ``compute`` (GEMMs) and ``comm`` (their collective, on its own link) cut into
    ``chunks`` pieces and pipelined: each GEMM piece waits for its piece of the collective
    (Megatron's TP-comm overlap: the all-gather in chunks ahead of the column-parallel GEMM,
    the reduce-scatter behind the row-parallel one, which is the same time reversed)."""
    if chunks < 1 or comm <= 0:
        return compute + max(comm, 0.0)
    ops: list[Op] = []
    for _ in range(chunks):
        ops.append(Op("link", comm / chunks))
        ops.append(Op("compute", compute / chunks, (len(ops) - 1,)))
    return max(run(ops))


__all__ = ["Op", "Pieces", "run", "layer_overlap", "chunked_overlap", "EXACT_LAYERS"]
