"""Layers -> pipeline stages: contiguous slices that minimise the most expensive stage.

A pipeline runs at the pace of its slowest stage, so ``partition`` chooses the contiguous split of
``n_layers`` transformer blocks into ``n_stages`` non-empty slices whose largest cost is smallest.
The embedding rides on stage 0 and the final norm + output head on the last stage; both have a
cost of their own, which is why an even split of the *layers* is not an even split of the *work*
(with a 128k vocabulary the Llama-3 8B head alone is worth ~1.3 layers of FLOPs).

The optimum is exact: dynamic programming over (stages used, layers used), O(n_stages * n_layers^2)
additions, at most a few hundred thousand for any real model. Among the splits reaching that
optimum, a second pass picks the most even one (least sum of squared stage costs); remaining
ties go to the earliest cuts, so the result is deterministic.

Default costs (``stage_costs``) are training matmul FLOPs per token, relative to one block, from
the same counting rule as ``loom.train.flops`` (a matmul of k x n weights costs 2·k·n FLOPs per
token forward, backward twice that, so the ratio is that of the forward):

    block   2·D·(N·Hd) + 2·D·(K·Hd) + c·D·F  (q, o, k, v, MLP weights)  + 2·S·(N·Hd)  (scores)
            (c = 3 for SwiGLU, 2 for GELU: ``TransformerArgs.mlp_matrices``)
    head    D·V                                 (one D x V matmul)
    embed   0                                   (a gather: no matmul FLOPs)

so the head weighs D·V / block ≈ V / (12·D) for the GPT shape (12·D² weights per block). The
embedding's lookup and the scatter-add of its gradient are memory traffic of S·D elements per
sequence, negligible next to a block; pass a measured ``embedding_cost`` (profiled time relative
to a block) when that is not so. Nothing here imports torch or communicates.
"""

from __future__ import annotations

from collections.abc import Sequence

from loom.models.args import TransformerArgs


def stage_costs(args: TransformerArgs, seq_len: int | None = None) -> dict[str, float]:
    """Predicted costs relative to one transformer block: ``layer`` (1.0), ``embedding``, ``head``."""
    seq_len = seq_len or args.max_seq_len
    q_width, kv_width = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    block = (2 * args.dim * q_width + 2 * args.dim * kv_width
             + args.mlp_matrices * args.dim * args.ffn_dim)
    block += 2 * seq_len * q_width  # Q·Kᵀ and probs·V, per token, as multiply-adds
    return {"layer": 1.0, "embedding": 0.0, "head": args.dim * args.vocab_size / block}


def partition(
    n_layers: int,
    n_stages: int,
    layer_cost: float | Sequence[float] = 1.0,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
) -> list[range]:
    """Split layers ``0..n_layers-1`` into ``n_stages`` contiguous, non-empty ranges minimising the
    largest stage cost. ``layer_cost`` is one number or one per layer (profiled); the embedding
    adds to stage 0, the head to the last stage."""
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} non-empty stages; "
                         f"need n_layers >= n_stages")
    costs = [float(layer_cost)] * n_layers if isinstance(layer_cost, (int, float)) \
        else [float(c) for c in layer_cost]
    if len(costs) != n_layers:
        raise ValueError(f"layer_cost has {len(costs)} entries for {n_layers} layers")
    if min(costs + [embedding_cost, head_cost]) < 0:
        raise ValueError("costs must be >= 0")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def cost_of(stage: int, start: int, stop: int) -> float:
        extra = (embedding_cost if stage == 0 else 0.0) + (head_cost if stage == n_stages - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    def solve(limit: float | None) -> tuple[float, list[int]]:
        # best[s][j]: the optimum placing layers 0..j-1 on stages 0..s-1; cut[s][j] is where
        # stage s-1 starts in it. Without ``limit`` the objective is the largest stage cost;
        # with it, the sum of squared stage costs among splits whose stages all stay <= limit.
        # Only j in s..s + width - 1 can be reached (every stage non-empty), so the tables hold
        # that band, at j - s: full rows were n_stages x n_layers (8,192 of each:
        # two tables of 6.7 x 10^7 slots, 1.3 GB peak for `loom estimate-memory` then).
        inf = float("inf")
        width = n_layers - n_stages + 1
        best = [[inf] * width for _ in range(n_stages + 1)]
        cut = [[0] * width for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, n_stages + 1):
            previous, row, cuts = best[s - 1], best[s], cut[s]
            for j in range(s, s + width):
                for i in range(s - 1, j):
                    cost = cost_of(s - 1, i, j)
                    if limit is None:
                        value = max(previous[i - s + 1], cost)
                    elif cost <= limit:
                        value = previous[i - s + 1] + cost * cost
                    else:
                        continue
                    if value < row[j - s] - 1e-12:
                        row[j - s], cuts[j - s] = value, i
        bounds = [n_layers]
        for s in range(n_stages, 0, -1):
            bounds.append(cut[s][bounds[-1] - s])
        return best[n_stages][width - 1], bounds[::-1]

    # Two passes: the smallest largest stage, then, among the splits that reach it, the most even
    # one (least sum of squares), so stages the bottleneck does not constrain are not lopsided.
    optimum, _ = solve(None)
    _, bounds = solve(optimum + 1e-9 * max(1.0, optimum))
    return [range(bounds[k], bounds[k + 1]) for k in range(n_stages)]


def partition_model(args: TransformerArgs, n_stages: int, seq_len: int | None = None, *,
                    vocab_spread: bool = False) -> list[range]:
    """``partition`` with the predicted costs of ``stage_costs``. ``vocab_spread``: the
    embedding and the head are split over every pipeline rank (``parallel.vocab_parallel_pp``),
    which adds the same work to each, so the layers alone are balanced."""
    costs = stage_costs(args, seq_len)
    if vocab_spread:
        return partition(args.n_layers, n_stages, costs["layer"])
    return partition(args.n_layers, n_stages, costs["layer"], costs["embedding"], costs["head"])


def max_stage_cost(ranges: Sequence[range], layer_cost: float | Sequence[float] = 1.0,
                   embedding_cost: float = 0.0, head_cost: float = 0.0) -> float:
    """The largest stage cost of a split (for tests and for printing a plan)."""
    n_layers = ranges[-1].stop
    costs = [float(layer_cost)] * n_layers if isinstance(layer_cost, (int, float)) \
        else list(layer_cost)
    totals = [sum(costs[i] for i in r) for r in ranges]
    totals[0] += embedding_cost
    totals[-1] += head_cost
    return max(totals)
