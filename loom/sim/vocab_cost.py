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

The rows' data-parallel collectives (``rows_data_parallel``) follow the ZeRO stage and are
exposed: they run after the schedule (the gradients' reduction) or before it (ZeRO-3's gather).

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


def rows_parameters(vocab: int, dim: int, lay: Layout, tied: bool) -> float:
    """One rank's vocabulary rows: V/(pp x tp) rows of D of the embedding, and as many of the
    head unless ``tied`` (one Parameter)."""
    return vocab * dim / (lay.pp * lay.tp) * (1 if tied else 2)


def rows_data_parallel(rows: float, lay: Layout, *, grad_bytes: float, gather_bytes: float,
                       shard_link: Any, rep_link: Any, dp_link: Any) -> float:
    """Seconds per step of the data-parallel collectives of one rank's ``rows`` parameters
    (``loom.parallel.vocab_pipeline.data_parallel_rows``), all exposed: their gradients are
    complete only after the embedding's backward, which follows the schedule (the runtime
    reduces them after it, no backward left to hide behind), and the step's first action, the
    embedding's lookup, needs them whole. By ZeRO stage on dp_shard, with ``grad_bytes`` a
    gradient element and ``gather_bytes`` a gathered parameter's (ZeRO-3: the compute dtype;
    ZeRO-1/2: ``CostModel.zero12_gather_bytes``):

    * ZeRO-3 (``GatheredRows``): one all-gather of the rows at the step's start and one
      reduce-scatter of their gradients after the embedding's backward, whatever
      ``reshard_after_forward`` says; HSDP's all-reduce of the slices over dp_replicate;
    * ZeRO-1/2: the reduce-scatter of the gradients (and HSDP's all-reduce of the slices), the
      optimizer's all-gather of the updated slices;
    * none: one all-reduce over dp.

    Under cp the cp ranks hold the same rows, so they join every group, as for the stages'
    parameters: ZeRO shards over dp_shard x cp, the plain all-reduce runs over dp x cp (the
    links given are those groups'). No ep with the split (config rules)."""
    if lay.zero_stage and lay.dp_shard > 1:
        shard = lay.dp_shard * lay.cp
        return (gather_time(rows * grad_bytes, shard, shard_link)
                + allreduce_time(rows * grad_bytes / shard, lay.dp_replicate, rep_link)
                + gather_time(rows * gather_bytes, shard, shard_link))
    return allreduce_time(rows * grad_bytes, lay.dp_replicate * lay.dp_shard * lay.cp, dp_link)


__all__ = ["VocabPasses", "rows_data_parallel", "rows_parameters", "vocab_pass_times",
           "vocab_pp", "vocab_shares", "vocab_stats_time"]
