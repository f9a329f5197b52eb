"""The planner's price of vocabulary parallelism across the pipeline (``Layout.vocab_parallel_pp``,
``loom.parallel.vocab_pipeline``): every rank runs 1/p of the output head as its S and T passes
instead of the last stage all of it, and the step gains that scheme's messages.

Per microbatch, with p = pp, t = tp, N = b·s/cp tokens, D the model width, e bytes an element,
and the head's (F, I, W) seconds over V/t columns as the cost model prices them:

* S (one rank): 1/p of the head's forward;
* T (one rank): 1/p of its backward (input and weight gradients), plus the all-gather of the
  ``[3, N]`` fp32 softmax statistics over pp, and over tp first under tp;
* the last stage's extra forward: X (N·D·e bytes) sent to the p - 1 other ranks; its extra
  backward: the p - 1 parts of dX received, all-reduced over tp in fp32 (4·N·D bytes);
* the step's edges: the split embedding's partial outputs into the first stage and their input
  gradients back, p - 1 messages of N·D·e each way, plus the tp all-reduce, on the first rank's
  link, exposed once per microbatch.

Within a rank, S goes with the forwards, T's input-gradient half and the statistics with the
input gradients and its weight-gradient half with the weight gradients, split evenly over the
rank's stages (the schedule inserts S and T where they overlap the pipeline's barriers,
``loom.schedule.vocab_passes``, within 4.3% of the work spread evenly). The functions here are
pure: ``CostModel`` (``loom.sim.cost_model``) hands them its head times and links. Nothing is
communicated here; this prices what the runtime communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.layout import Layout
from loom.sim.collectives import allreduce_time, gather_time, p2p_time

# (S, T, the last stage's extra F, its extra I, the step's edges), seconds per microbatch
VocabPasses = tuple[float, float, float, float, float]


def vocab_pp(lay: Layout) -> bool:
    """Whether ``lay`` splits the embedding and head over its pipeline's ranks."""
    return lay.vocab_parallel_pp and lay.pp > 1


def vocab_pass_times(lay: Layout, dim: int, seq_len: int, dtype_bytes: int,
                     head: tuple[float, float, float], pp_link: Any, tp_link: Any) -> VocabPasses:
    """(S, T, X sent, dX received, the edges' messages) of one microbatch (module docstring):
    ``head`` is the whole head's (F, I, W) seconds on one rank over V/t columns, ``pp_link`` and
    ``tp_link`` the links of the pp and tp groups, ``dim`` the model width."""
    p, t = lay.pp, lay.tp
    tokens = lay.micro_batch * seq_len // lay.cp
    stats = gather_time(4 * 3 * tokens * p, p, pp_link) + gather_time(
        4 * 3 * tokens * t, t, tp_link)
    activation = tokens * dim * dtype_bytes
    s_pass = head[0] / p
    t_pass = (head[1] + head[2]) / p + stats
    x_out = (p - 1) * p2p_time(activation, pp_link)
    dx_in = (p - 1) * p2p_time(activation, pp_link) + allreduce_time(4 * tokens * dim, t,
                                                                     tp_link)
    edges = 2 * (p - 1) * p2p_time(activation, pp_link) + allreduce_time(
        4 * tokens * dim, t, tp_link)
    return s_pass, t_pass, x_out, dx_in, edges


def vocab_shares(pp: int, owned: Sequence[Sequence[int]], passes: VocabPasses,
                 head: tuple[float, float, float]) -> list[tuple[float, float, float]]:
    """Per global stage, the (F, I, W) seconds its rank's vocabulary passes add (``owned``: each
    rank's global stages; ``passes``: ``vocab_pass_times``): S with the forwards, T's
    input-gradient half and the statistics with the input gradients, its weight-gradient half
    with the weight gradients, split evenly over the rank's stages; the last stage adds sending
    X to its F and receiving the parts of dX to its I."""
    s_pass, t_pass, x_out, dx_in, _ = passes
    weight = head[2] / pp
    last = sum(len(own) for own in owned) - 1
    shares: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * (last + 1)
    for own in owned:
        v = len(own)
        for s in own:
            f, i, w = s_pass / v, (t_pass - weight) / v, weight / v
            if s == last:
                f, i = f + x_out, i + dx_in
            shares[s] = (f, i, w)
    return shares


def vocab_stats_time(passes: VocabPasses, head: tuple[float, float, float], pp: int) -> float:
    """The statistics' all-gathers inside T: T less its 1/p of the head's backward."""
    return passes[1] - sum(head[1:]) / pp


__all__ = ["VocabPasses", "vocab_pass_times", "vocab_pp", "vocab_shares", "vocab_stats_time"]
