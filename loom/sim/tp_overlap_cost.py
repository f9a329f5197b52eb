"""What TP-comm overlap costs beyond the collectives it hides, for the planner's cost model:
the GEMMs a stack runs beside its communication kernels get only the SMs those leave.

Megatron's ``--tp-comm-overlap`` is Transformer Engine's userbuffers. Their defaults
(``transformer_engine/pytorch/module/base.py``, ``initialize_ub``) overlap the all-gathers by
ring exchange on the copy engines (one SM), but run the reduce-scatter behind the
row-parallel forward GEMMs (out-projection, fc2: "pipeline") and the bulk overlaps beside the
column-parallel backward GEMMs (qkv and fc1 dgrad and wgrad: "bulk") on 16 SMs each,
launching those GEMMs with a 16-SM margin (``Framework.tp_overlap_sms``). On an H100's 132
SMs (``Gpu.sms``) they take 132/116 as long. An MoE layer's routed experts are not
TP-overlapped.

Its own module because it is a fact of one stack's overlap, priced apart from the chunked
pipelining ``loom.sim.streams.chunked_overlap`` models; torch-free, communicates nothing.
"""

from __future__ import annotations

from loom.models.args import TransformerArgs


def sm_margin_seconds(model: TransformerArgs, tokens: float, tp: int, moe: bool, sms: int,
                      reserved: int, seconds_per_flop: float) -> tuple[float, float]:
    """(forward, each backward pass's) extra seconds of one layer's GEMMs run with
    ``reserved`` of the accelerator's ``sms`` SMs given to communication: forward the
    out-projection and fc2, backward qkv and fc1 (their dgrad in I, their wgrad in W, the same
    FLOPs each), at ``seconds_per_flop``. 0 where nothing is reserved or the SMs are not
    known."""
    if not reserved or sms <= reserved:
        return 0.0, 0.0
    qkv = 2 * tokens * model.dim * model.head_dim * (model.n_heads + 2 * model.n_kv_heads) / tp
    proj = 2 * tokens * model.head_dim * model.n_heads * model.dim / tp
    fc1 = 0.0 if moe else 2 * tokens * model.dim * model.ffn_dim * (model.mlp_matrices - 1) / tp
    fc2 = 0.0 if moe else 2 * tokens * model.ffn_dim * model.dim / tp
    longer = sms / (sms - reserved) - 1
    return (proj + fc2) * seconds_per_flop * longer, (qkv + fc1) * seconds_per_flop * longer


__all__ = ["sm_margin_seconds"]
