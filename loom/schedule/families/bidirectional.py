"""Bidirectional V: two V-shaped pipelines in opposite directions, in the spirit of BitPipe (Wu et
al. 2024, "BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating Large Models
Training", arXiv 2410.19367), which fuses Chimera's two directions with interleaved V chunks.

Placement. The model is cut into L = 2p stages and held twice. Copy 0 ("down") is a V: stage j
on rank v(j), that is ranks 0..p-1 and then back p-1..0, as in ZB-V. Copy 1 ("up") is the mirror
image: stage j on rank p-1-v(j). Rank r thus holds stages r and 2p-1-r of copy 0 and p-1-r and
p+r of copy 1: four chunks, twice a V schedule's weights. Microbatches alternate, even ones down
and odd ones up (``Schedule.routes``), so both ends of the pipeline start working at once.

Order. Loom derives the per-rank order with its greedy list scheduler (``_greedy.py``) under
1F1B's activation budget of p units per rank, with the backward split into I and W, for any m;
BitPipe's own hand-built order on this placement (full backwards, units of p microbatches) is
the family ``bitpipe`` (``loom.schedule.families.bitpipe``). Measured in
docs/design.md with F = I = W: the bubble is below 1F1B's and at most interleaved 1F1B's, with
a lower activation peak than either; it is above ZB-V's. Full backwards under the same budget
do worse than 1F1B.

Training. A microbatch visits one copy of each stage, so the two copies' weight gradients are
summed before the optimizer step: rank r and its mirror p-1-r hold the same four model stages
(one copy each), and ``loom.pipeline.route_copies`` all-reduces their gradients over that pair,
one model stage at a time, after the data-parallel average. BitPipe's eager gradient
synchronisation: without a data-parallel reducer a stage's sum starts as soon as both ranks
are past its last W or B, overlapping the rest of the schedule (the greedy order defers W
pieces to the drain, so that is the last few percent of the step; see docs/design.md); the
result is bit-identical to one sum at the step's end. ZeRO-1/2 sum the reduced flat slices,
which line up on mirror ranks. Both copies start from the same seeded weights and step
identically, so they stay bit-identical; the global norm counts each parameter once (on its
route-0 copy's rank; under ZeRO-1/2 the sharded optimizer leaves the replicas' slices out) and
checkpoints write each name once (DCP deduplicates the identical replicas). The schedule is
valid for any m >= 1 (an even m balances the copies); training needs m >= 2 (each copy must see
a microbatch) and an even p (with an odd p the middle rank holds both copies of its stages).
Tied embeddings: each copy's two ends sit on one rank (copy 0's on rank 0, copy 1's on rank p-1)
and share one Parameter there. ``loom schedule show|simulate|export`` work as for every family;
PyTorch's CSV cannot hold the routes, so the CSV export adds a last ``routes=2,...`` row, Loom's
extension that ``Schedule.from_torch_csv`` reads back (JSON holds them natively).
"""

from __future__ import annotations

from loom.schedule.ir import Schedule, v_placement
from loom.schedule.families._common import check_sizes
from loom.schedule.families._greedy import greedy_schedule


def bidirectional_placement(pp_size: int) -> tuple[int, ...]:
    """Stage -> rank for both copies: the V (stages 0..2p-1), then its mirror (2p..4p-1)."""
    down = v_placement(pp_size, 2)
    return down + tuple(pp_size - 1 - rank for rank in down)


def bidirectional_v(pp_size: int, microbatches: int) -> Schedule:
    """Two opposite V pipelines over two model copies (BitPipe's shape); m >= 1. Uses I and W.

    Microbatches alternate between the copies; trainable for an even p and m >= 2."""
    check_sizes("bidirectional_v", pp_size, microbatches)
    return greedy_schedule("bidirectional_v", bidirectional_placement(pp_size), microbatches,
                           pp_size, num_routes=2, routes=[mb % 2 for mb in range(microbatches)])
