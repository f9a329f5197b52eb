"""DualPipeV: the V-shaped, single-copy variant of DualPipe (DeepSeek-AI 2024, "DeepSeek-V3
Technical Report", arXiv 2412.19437 §3.2.1; deepseek-ai/DualPipe, ``dualpipev.py``).

Two stages per rank in a V (rank r owns stages r and 2p-1-r). The steady state pairs the forward
of one chunk with the full backward of the other so that, on hardware, one pair's communication
hides behind the other's compute; Loom's IR has no fused action, so each pair is written as the
forward followed by the backward (torch's ``(F;B)OVERLAP_F_B`` flattens to the same order) and a
lowering pass may fuse adjacent pairs again. Backwards are full (B) except in the drain, where
they split into I and W to fill the tail, so one schedule mixes B and I/W across microbatches.

Phases of rank r: 2(p-r-1) forwards of chunk 0; r+1 pairs F0 F1; p-r-1 rounds I1 W F1; the main
loop F0 B1 F1 B0 (m-2p+r+1 times); p-r-1 rounds B1 F1 B0; r+1 pairs B1 B0 (switching to I
halfway); p-r-1 rounds W B0/I0; r+1 closing W's. Valid for m >= 2p (the main loop must run at
least once on rank 0), as torch's ScheduleDualPipeV requires.
"""

from __future__ import annotations

from collections import deque

from loom.schedule.ir import Action, Op, Schedule, v_placement
from loom.schedule.families._common import RankWriter, check_sizes, make_schedule


class _DualPipeVWriter(RankWriter):
    """Numbers B and I from one backward counter per chunk and queues the W of each I."""

    def __init__(self, stages: tuple[int, int]):
        super().__init__(stages)
        self.weights: deque[Action] = deque()

    def backward(self, chunk: int, split: bool) -> None:
        mb = self.count[chunk, Op.I]
        self.count[chunk, Op.I] += 1
        self.actions.append(Action(self.stages[chunk], Op.I if split else Op.B, mb))
        if split:
            self.weights.append(Action(self.stages[chunk], Op.W, mb))

    def weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.popleft())


def dualpipev(pp_size: int, microbatches: int) -> Schedule:
    """DualPipeV with two stages per rank (V placement); valid for m >= 2p. Mixes B and I/W."""
    check_sizes("dualpipev", pp_size, microbatches, min_microbatches=2 * pp_size)
    p, m = pp_size, microbatches
    rows = []
    for rank in range(p):
        w = _DualPipeVWriter((rank, 2 * p - 1 - rank))
        before, after = p - rank - 1, rank + 1  # ranks downstream / up to and including this one
        for _ in range(2 * before):
            w.add(0, Op.F)
        for _ in range(after):
            w.add(0, Op.F)
            w.add(1, Op.F)
        for _ in range(before):
            w.backward(1, split=True)
            w.weight()
            w.add(1, Op.F)
        for _ in range(m - 2 * p + after):
            w.add(0, Op.F)
            w.backward(1, split=False)
            w.add(1, Op.F)
            w.backward(0, split=False)
        for _ in range(before):
            w.backward(1, split=False)
            w.add(1, Op.F)
            w.backward(0, split=False)
        split = False
        for i in range(after):
            # halfway through, backwards split so the drain's W's can fill the tail bubble;
            # odd ranks switch one backward earlier than even ranks
            split = split or (i == after // 2 and rank % 2 == 1)
            w.backward(1, split)
            split = split or (i == after // 2 and rank % 2 == 0)
            w.backward(0, split)
        for _ in range(before):
            w.weight()
            w.backward(0, split)
        for _ in range(after):
            w.weight()
        rows.append(w.actions)
    return make_schedule("dualpipev", v_placement(p, 2), m, rows)
