"""Which layers and how many parameters each pipeline rank holds under a layout.

``RankParams(model, fp8_all_gather=..., loom_trainer=...)`` answers the counting questions the
cost model (time of the data-parallel collectives, the optimizer's bytes) and ``cost_memory``
(model state per rank) both ask: how the layers split over the global stages and which rank
owns which stage (``geometry``), the parameters of one dense or MoE layer on one rank split by
tp and ep (``layer_params``), those of the end ranks, which also carry the embedding and the
head (``end_rank_params``; routed experts apart: ``end_rank_expert_params``, ZeRO shards them
over fewer ranks), and the FP8 linears' share that FSDP2's float8 all-gather moves at one byte.

It is its own module because it is a concept of its own (the layer placement Loom's pipeline
builder uses, the parameter counts of ``loom.models``), read by two pricing modules; it prices
nothing and communicates nothing. Every answer is cached by the shape it depends on: the
planner asks for tens of thousands of layouts that share a few hundred shapes, and callers
read the cached dictionaries without changing them.
"""

from __future__ import annotations

from typing import Any

from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.schedule.ir import v_placement
from loom.sim.vocab_cost import vocab_pp

# per global stage (dense layers, MoE layers); the stage -> rank placement; each rank's stages
Geometry = tuple[list[tuple[int, int]], tuple[int, ...], list[list[int]]]


class RankParams:
    """Layer placement and parameter counts of ``model``'s pipeline ranks, cached per shape."""

    def __init__(self, model: TransformerArgs, *, fp8_all_gather: bool = False,
                 loom_trainer: bool = True):
        self.model = model
        # FSDP2 gathers the FP8 linears in float8; Loom's trainer builds that gather only at tp 1
        self.fp8_all_gather, self.loom_trainer = fp8_all_gather, loom_trainer
        self.moe_layers = sum(1 for i in range(model.n_layers) if self.is_moe(i))
        self._geometry: dict[tuple, Geometry] = {}
        self._layers: dict[tuple, Any] = {}  # rank_layers, distinct_ranks
        self._params: dict[tuple, dict[int, float]] = {}  # end_rank_params, ..._expert_params

    def is_moe(self, i: int) -> bool:
        """Whether layer ``i`` is a mixture-of-experts layer."""
        return bool(self.model.n_experts) and self.model.moe_layer(i)

    def geometry(self, pp: int, chunks: int, v_shaped: bool) -> Geometry:
        """Per global stage its (dense, MoE) layer counts, the stage -> rank placement, and each
        rank's stages. Layers split evenly, the remainder on the middle stages (the ends also
        carry the embedding and the head); a V (or Hanayo's snake of ``chunks`` sweeps) places
        stages by ``loom.schedule.ir.v_placement``, otherwise round robin."""
        key = (pp, chunks, v_shaped)
        found = self._geometry.get(key)
        if found is None:
            stages = pp * chunks
            base, extra = divmod(self.model.n_layers, stages)
            order = sorted(range(stages), key=lambda s: abs(s - (stages - 1) / 2))
            sizes = [base + (1 if s in order[:extra] else 0) for s in range(stages)]
            counts, start = [], 0
            for size in sizes:
                moe = sum(1 for i in range(start, start + size) if self.is_moe(i))
                counts.append((size - moe, moe))
                start += size
            if v_shaped:
                placement = v_placement(pp, max(chunks, 2))
            else:
                placement = tuple(s % pp for s in range(stages))
            owned = [[s for s in range(stages) if placement[s] == r] for r in range(pp)]
            found = self._geometry[key] = (counts, placement, owned)
        return found

    def rank_layers(self, pp: int, chunks: int, v_shaped: bool) -> frozenset[tuple]:
        """The distinct (dense layers, MoE layers, holds the head) of the pipeline's ranks."""
        key = ("layers", pp, chunks, v_shaped)
        found = self._layers.get(key)
        if found is None:
            counts, _, owned = self.geometry(pp, chunks, v_shaped)
            last = len(counts) - 1
            found = self._layers[key] = frozenset(
                (sum(counts[s][0] for s in own), sum(counts[s][1] for s in own), last in own)
                for own in owned)
        return found

    def distinct_ranks(self, pp: int, chunks: int, v_shaped: bool) -> list[list[int]]:
        """The stages of one rank of each kind: ranks whose stages hold the same (dense, MoE)
        layers in the same order, and the last stage or not (the lowest rank of each kind)."""
        key = ("distinct", pp, chunks, v_shaped)
        found = self._layers.get(key)
        if found is None:
            counts, _, owned = self.geometry(pp, chunks, v_shaped)
            kinds = {(tuple(counts[s] for s in own), len(counts) - 1 in own): own
                     for own in reversed(owned)}
            found = self._layers[key] = list(kinds.values())
        return found

    def layer_params(self, moe: bool, lay: Layout) -> float:
        """Parameters of one (MoE or dense) layer one rank holds (experts split by ep and tp;
        each expert, routed or shared, of the dense MLP's kind: ``mlp_matrices`` D x F_e)."""
        m = self.model
        attn = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) / lay.tp
        norms = 2 * m.dim
        if moe:
            width = m.expert_ffn_dim or m.ffn_dim
            experts = m.mlp_matrices * m.dim * width * m.n_experts / (lay.ep * lay.tp)
            shared = m.mlp_matrices * m.dim * width * m.n_shared_experts / lay.tp
            return attn + norms + experts + shared + m.dim * m.n_experts
        return attn + norms + m.mlp_matrices * m.dim * m.ffn_dim / lay.tp

    def fp8_layer_params(self, moe: bool, lay: Layout) -> float:
        """Parameters of one (MoE or dense) layer's FP8 linears on one rank (the attention
        projections and the dense or shared-expert MLP, as ``loom.parallel.fp8.converts``),
        split by tp: what the float8 all-gather moves at 1 byte. None without that gather, or
        where Loom's trainer does not build it (tp > 1)."""
        if not self.fp8_all_gather or (self.loom_trainer and lay.tp > 1):
            return 0.0
        m = self.model
        attn = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
        if moe:
            shared = (m.mlp_matrices * m.dim * (m.expert_ffn_dim or m.ffn_dim)
                      * m.n_shared_experts)
            return (attn + shared) / lay.tp
        return (attn + m.mlp_matrices * m.dim * m.ffn_dim) / lay.tp

    def fp8_gathered_params(self, lay: Layout) -> dict[int, float]:
        """``fp8_layer_params`` summed over the layers of the end pipeline ranks."""
        dense, moe = self.fp8_layer_params(False, lay), self.fp8_layer_params(True, lay)
        counts, _, owned = self.geometry(lay.pp, lay.chunks, lay.v_shaped)
        return {r: sum(counts[s][0] * dense + counts[s][1] * moe for s in owned[r])
                for r in {0, lay.pp - 1}}

    def end_rank_params(self, lay: Layout) -> dict[int, float]:
        """Parameters on the end pipeline ranks (the embedding's and the head's: the worst),
        routed experts included; under vocabulary parallelism across the pipeline every rank
        holds 1/pp of the embedding's and the head's rows."""
        key = (lay.pp, lay.chunks, lay.v_shaped, lay.tp, lay.ep, vocab_pp(lay))
        found = self._params.get(key)
        if found is None:
            found = self._params[key] = self._count_end_rank_params(lay)
        return found

    def _count_end_rank_params(self, lay: Layout) -> dict[int, float]:
        m = self.model
        counts, _, owned = self.geometry(lay.pp, lay.chunks, lay.v_shaped)
        last = len(counts) - 1
        dense_params = self.layer_params(False, lay)
        moe_params = self.layer_params(True, lay) if self.moe_layers else dense_params
        vocab = m.vocab_size * m.dim / lay.tp
        out = {}
        for r in sorted({0, lay.pp - 1}):
            psi = sum(counts[s][0] * dense_params + counts[s][1] * moe_params for s in owned[r])
            if vocab_pp(lay):  # every rank: V/(pp x tp) rows of the embedding and of the head
                rows = vocab / lay.pp
                out[r] = psi + rows * (1 if m.tie_embeddings else 2) + (
                    m.dim if last in owned[r] else 0)  # the final norm
                continue
            if 0 in owned[r]:
                psi += vocab
            if last in owned[r]:
                psi += m.dim + (0 if m.tie_embeddings and lay.pp == 1 else vocab)
            out[r] = psi
        return out

    def end_rank_expert_params(self, lay: Layout) -> dict[int, float]:
        """Routed-expert parameters on the end pipeline ranks (E / ep experts of every MoE
        layer, split by expert-TP = tp): ZeRO shards them over dp_shard x cp only."""
        key = ("experts", lay.pp, lay.chunks, lay.v_shaped, lay.tp, lay.ep)
        found = self._params.get(key)
        if found is None:
            m = self.model
            counts, _, owned = self.geometry(lay.pp, lay.chunks, lay.v_shaped)
            per_layer = (m.mlp_matrices * m.dim * (m.expert_ffn_dim or m.ffn_dim) * m.n_experts
                         / (lay.ep * lay.tp))
            found = self._params[key] = {
                r: sum(counts[s][1] for s in owned[r]) * per_layer for r in {0, lay.pp - 1}}
        return found
