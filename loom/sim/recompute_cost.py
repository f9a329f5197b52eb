"""What a recomputation policy runs again in a block's backward, stated once for both halves
of the planner's cost model: the seconds it adds to a layer's I pass
(``CostModel._layer_times``) and the FLOPs it adds to the step's hardware count
(``CostModel.evaluate``, HFU's numerator).

* ``full`` and ``every_k``: the whole forward of the recomputed share of the blocks
  (``loom.formulas.memory.recomputed_fraction``: all, or every k-th block);
* ``selective`` as Megatron, DeepSpeed and Loom define it (``Framework.selective == "core"``,
  Korthikanti et al. 2022): the attention core's forward;
* ``selective`` as torchtitan defines it (``"ops"``, its op-level policy): the even matmuls
  (wk, wo and w3: ``loom.formulas.memory.op_sac_recomputed_flops``) and every element-wise op
  of the forward.

Its own module because the two halves used to encode each policy apart; torch-free,
communicates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.formulas.memory import op_sac_recomputed_flops, recomputed_fraction
from loom.layout import Layout
from loom.models.args import TransformerArgs


@dataclass(frozen=True)
class Recomputed:
    """What one block runs again per microbatch in its backward."""

    forward_share: float  # of its whole forward (full: 1; every_k: the share of the blocks)
    matmul_flops: float  # the matmuls alone that run again (op-level), for the tokens asked
    attention_core: bool  # the attention core's forward (selective, "core")
    elementwise: bool  # every element-wise op of the forward (op-level)


def recomputed(lay: Layout, selective: str, model: TransformerArgs, tokens: float, tp: int,
               moe: bool) -> Recomputed:
    """What ``lay``'s policy recomputes of one (MoE or dense) block of ``model`` on one rank
    for ``tokens`` tokens, under the framework's meaning of "selective" (``selective``)."""
    share = recomputed_fraction(lay.recompute, lay.recompute_every, model.n_layers)
    ops = lay.recompute == "selective" and selective == "ops"
    width = (model.expert_ffn_dim or model.ffn_dim) if moe else model.ffn_dim
    matmuls = op_sac_recomputed_flops(tokens=tokens, h=model.dim, f=width, a=model.n_heads,
                                      kv=model.n_kv_heads, t=tp) if ops else 0.0
    return Recomputed(share, matmuls, lay.recompute == "selective" and not ops, ops)


__all__ = ["Recomputed", "recomputed"]
