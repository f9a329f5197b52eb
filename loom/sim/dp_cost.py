"""The data-parallel part of a step's time for the planner's cost model (``CostModel.evaluate``).

``data_parallel_time`` prices, on the worst pipeline end rank, the gradient reduction and ZeRO's
parameter gathers: each collective (alpha-beta, ``loom.sim.collectives``) is cut into one piece
per layer and queued on its link's stream (``loom.sim.streams``) behind the layer passes it
overlaps, as the framework profile's ``Overlap`` says (behind the last microbatch's backward,
across the pipeline flush, or not at all; ZeRO-3's gathers ahead of each layer; ZeRO-1/2's
parameter all-gather after the step or behind the next forward). What each rank holds comes from
``CostModel.ranks``; the layer passes it hides behind from the model's stage costs. It
communicates nothing. Split from ``cost_model.py``, whose docstring lists the formulas, to keep
that module about compute and the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.layout import Layout
from loom.sim.collectives import allreduce_time, gather_time
from loom.sim.streams import Pieces
from loom.sim.vocab_cost import rows_data_parallel, rows_parameters, vocab_pp

if TYPE_CHECKING:  # the cost model imports this module
    from loom.sim.cost_model import CostModel


def data_parallel_time(cost: CostModel, lay: Layout, rank_params: dict[int, float],
                       rank_fwd: dict[int, float], rank_bwd: dict[int, float],
                       rank_layers: dict[int, int]) -> tuple[float, float]:
    """(exposed seconds, total seconds) of gradient reduction and ZeRO parameter gathers on
    the worst pipeline rank. Each collective is cut into one piece per layer and queued on
    its link's stream (``loom.sim.streams``) behind the layer passes it overlaps, so the
    collectives that share a link (ZeRO-3's gathers and reduce-scatters in one backward)
    take their sum there; the framework's ``Overlap`` says what overlaps what."""
    c, fw = cost.cluster, cost.framework.overlap
    group = lay.dp_replicate * lay.dp_shard * lay.ep * lay.cp
    worst_exposed = worst_total = 0.0
    if group <= 1:
        return 0.0, 0.0
    experts = cost.ranks.end_rank_expert_params(lay)
    zero = cost.zero_stage_of(lay)
    fp8 = cost.ranks.fp8_gathered_params(lay)  # gathered at 1 byte under ZeRO-3
    # the rank distances of the dense groups (the experts' groups are priced on the same)
    strides = cost.group_strides(lay)
    shard_stride, rep_stride, dp_stride = strides["shard"], strides["rep"], strides["dp"]
    # the vocabulary rows (vocab-pp): reduced after the schedule, exposed (``vocab_cost``)
    rows = rows_parameters(cost.model.vocab_size, cost.model.dim, lay,
                           cost.model.tie_embeddings) if vocab_pp(lay) else 0.0
    rows_time = rows_data_parallel(  # under cp over dp x cp too, as the stages' below
        rows, lay, grad_bytes=cost.grad_bytes,
        gather_bytes=cost.e if zero == 3 else cost.zero12_gather_bytes,
        shard_link=c.link_for(lay.dp_shard * lay.cp, shard_stride),
        rep_link=c.link_for(lay.dp_replicate, rep_stride),
        dp_link=c.link_for(lay.dp_replicate * lay.dp_shard * lay.cp, dp_stride)
    ) if rows else 0.0
    for r, psi in rank_params.items():
        layers = max(1, rank_layers[r])
        # per stream (a link's name): the reduction's and the gathers' seconds, whole step
        reduce: dict[str, float] = {}
        gather: dict[str, float] = {}
        # dense parameters are replicated over ep too, routed experts are not
        for count, over, in_fp8 in ((psi - experts[r] - rows, lay.ep, fp8[r]),
                                    (experts[r], 1, 0)):
            if zero:
                # ZeRO shards over dp_shard x cp (the cp ranks hold the same weights), dense
                # parameters also over ep; HSDP all-reduces the slices over dp_replicate
                shard = lay.dp_shard * lay.cp * over
                shard_link = c.link_for(shard, shard_stride)
                rep_link = c.link_for(lay.dp_replicate, rep_stride)
                _add(reduce, shard_link.name,
                     gather_time(count * cost.grad_bytes, shard, shard_link))
                _add(reduce, rep_link.name, allreduce_time(
                    count * cost.grad_bytes / shard, lay.dp_replicate, rep_link))
                width = cost.e if zero == 3 else cost.zero12_gather_bytes
                gathered = count * width - (in_fp8 * (width - 1) if zero == 3 else 0)
                _add(gather, shard_link.name, gather_time(gathered, shard, shard_link))
            else:
                n = lay.dp_replicate * lay.dp_shard * lay.cp * over
                link = c.link_for(n, dp_stride)
                _add(reduce, link.name, allreduce_time(count * cost.grad_bytes, n, link))
        red_total, ag_total = sum(reduce.values()), sum(gather.values())
        fwd_slice, bwd_slice = rank_fwd[r] / layers, rank_bwd[r] / layers
        reduce_pieces = [Pieces(k, v / layers) for k, v in reduce.items()]
        gather_pieces = [Pieces(k, v / layers, before=True) for k, v in gather.items()]
        # the window that hides the reduction: the last microbatch's backward of the rank,
        # under "pipeline_flush" widened to the drain after it (see ``flush_window``)
        slice_, slack = bwd_slice, 0.0
        if fw.grad_reduce == "pipeline_flush" and lay.pp > 1:
            slice_, slack = flush_window(lay, r, rank_bwd[r], layers)
        if zero == 3:
            # without a pipeline gathered per microbatch, forward and backward; with one
            # once per step per stage (kept through the schedule window)
            passes = 2 * lay.microbatches if lay.pp == 1 else 1
            total = red_total + passes * ag_total
            if not cost.overlaps or not fw.zero3_prefetch:
                exposed = passes * ag_total + _reduce_exposed(cost, 
                    layers, slice_, reduce_pieces, slack, red_total, fw.grad_reduce)
            elif lay.pp == 1:
                m = lay.microbatches
                fwd = cost.queued_overlap(layers, fwd_slice, gather_pieces)
                bwd = cost.queued_overlap(layers, bwd_slice, gather_pieces)
                last = cost.queued_overlap(layers, bwd_slice, gather_pieces + (
                    reduce_pieces if fw.grad_reduce != "none" else []))
                if fw.grad_reduce == "none":
                    last += red_total
                exposed = m * fwd + (m - 1) * bwd + last
            else:
                exposed = cost.queued_overlap(layers, fwd_slice, gather_pieces) + \
                    _reduce_exposed(cost, layers, slice_, reduce_pieces, slack, red_total,
                                         fw.grad_reduce)
        else:
            total = red_total + ag_total
            exposed = _reduce_exposed(cost, layers, slice_, reduce_pieces, slack, red_total,
                                           fw.grad_reduce)
            if zero and fw.param_gather and cost.overlaps:  # behind the next forward
                exposed += cost.queued_overlap(layers, fwd_slice, gather_pieces)
            else:  # after the optimizer step, before the next forward
                exposed += ag_total
        exposed, total = exposed + rows_time, total + rows_time
        worst_exposed = max(worst_exposed, exposed)
        worst_total = max(worst_total, total)
    return worst_exposed, worst_total


def _reduce_exposed(cost: CostModel, layers: int, slice_: float, pieces: list[Pieces],
                    slack: float, total: float, mode: str) -> float:
    """Exposed seconds of the gradient reduction: all of it when nothing overlaps it (the
    framework's choice, or ranks sharing cores), otherwise what its pieces, queued behind
    ``layers`` backward slices, leave past them and the ``slack``."""
    if mode == "none" or not cost.overlaps:
        return total
    return cost.queued_overlap(layers, slice_, pieces, slack)


def flush_window(lay: Layout, r: int, bwd: float, layers: int) -> tuple[float, float]:
    """(seconds per layer slice, slack) of rank ``r``'s gradient reduction when it overlaps
    the pipeline's flush (Megatron's ``--overlap-grad-reduce``: each model chunk's buckets
    are reduced once its last microbatch's backward is done). The last microbatch's
    backward runs down the stages, one stage backward b = bwd / v each, so rank r's stages
    r, r + p, ... finish theirs (v - 1)·p, ... stage backwards before its last: its v·layers
    pieces are released over a window of ((v - 1)·p + 1)·b, and it then idles r·b while
    the stages below it finish."""
    p, v = lay.pp, (2 if lay.v_shaped else lay.chunks)
    b = bwd / v
    window = ((v - 1) * p + 1) * b
    return window / layers, r * b


def _add(seconds: dict[str, float], stream: str, value: float) -> None:
    """Add ``value`` seconds to ``stream``'s entry (collectives grouped by the link they use)."""
    if value > 0:
        seconds[stream] = seconds.get(stream, 0.0) + value



__all__ = ["data_parallel_time", "flush_window"]
