"""MoE under context parallelism (cp > 1, dropless): sequences split over ranks.

A cp rank holds S/cp tokens of every sequence. Routing is per token; the balancing loss's
per-sequence statistics f and P are averaged over cp by one all-reduce per MoE layer per forward
(``context.SequenceStatisticsMean``), whose backward is the identity so that the gradients,
averaged over dp x cp, are one process's. Expert shards under ep are summed over cp as well.

Parity through the real ``Trainer`` with the base config, tolerances and comparison of
``test_expert_tp.py`` (``tiny-moe``: 1 dense + 3 MoE layers, 4 experts top-2, one shared expert;
3 AdamW steps in fp32 with clipping): cp2 ring, cp2 Ulysses, cp2 x ep2, cp2 x tp2 and cp2 x pp2
(1F1B; the balancing loss's gradient then joins inside the layers) against one process. Loss,
gradient norm and every parameter's full gradient must match. Each of these wrong variants fails
step 1 (checked by hand while writing the test): the statistics left local (each part's own
balancing loss), the all-reduce given the mean's own backward (gradient / cp), and, with ep,
expert gradients not summed over cp.

Communication: one forward + backward of a cp-parallel MoE model; the counted ``cp`` all-reduce
is exactly one call of 8*B*E bytes (f and P, fp32) per MoE layer in forward, ``2 (cp-1)/cp`` of
it on the wire, and nothing in backward (ratio measured / formula 1.00).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from loom.models import Transformer, TransformerArgs, reset_parameters
from loom.parallel.comm import CommLedger
from tests.dist.test_expert_tp import ROUTING, assert_layout_matches, references  # noqa: F401

LAYOUTS = {  # name: (world, degrees, extra overrides)
    "cp2-ring": (2, {"cp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ring"}),
    "cp2-ulysses": (2, {"cp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ulysses"}),
    "cp2-ep2-ring": (4, {"cp": 2, "ep": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ring"}),
    "cp2-tp2-ring": (4, {"cp": 2, "tp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ring"}),
    "cp2-pp2-ring": (4, {"cp": 2, "pp": 2, "dp_replicate": 1},
                     {"parallel.cp_mode": "ring", "parallel.schedule": "1f1b"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_context_parallel_trainer_matches_one_process(dist, small_data_dir, references,
                                                          layout):
    world, degrees, extra = LAYOUTS[layout]
    assert_layout_matches(dist, small_data_dir, references("dropless"), world, degrees,
                          {**ROUTING["dropless"], **extra}, f"{layout} dropless")


# -- communication volume ----------------------------------------------------------------------
B, S = 2, 32
ARGS = TransformerArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=128,
                       max_seq_len=S, n_experts=4, top_k=2, expert_ffn_dim=64, n_dense_layers=1)


def comm_body(ctx, mode: str) -> dict:
    """One forward + backward on this rank's shard of B sequences; the cp all-reduce records of
    each half."""
    from loom.parallel.context import (CPLayout, apply_context_parallel, new_cp_groups,
                                       shard_sequence)

    layout = CPLayout.from_mode(mode, ctx.world_size)
    groups = new_cp_groups([list(range(ctx.world_size))], layout, ctx.rank)
    ledger = CommLedger()
    model = Transformer(ARGS)
    reset_parameters(model, 1234)
    apply_context_parallel(model, groups, ledger)
    tokens = torch.randint(0, ARGS.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(7))
    (inputs, positions), (targets, _) = (shard_sequence(t, groups.cp_rank, layout)
                                         for t in (tokens[:, :-1], tokens[:, 1:]))
    halves = {}
    logits = model(inputs, positions=positions)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.1 * model.moe_aux_loss()
    halves["forward"] = dataclasses.asdict(ledger.get("cp", "all_reduce"))
    ledger.reset()
    loss.backward()
    halves["backward"] = dataclasses.asdict(ledger.get("cp", "all_reduce"))
    return halves


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_moe_statistics_all_reduce_bytes_match_the_formula(dist, mode):
    cp = 2
    moe_layers = sum(ARGS.moe_layer(i) for i in range(ARGS.n_layers))
    payload = moe_layers * 2 * B * ARGS.n_experts * 4  # f and P, [2, B, E] fp32, per MoE layer
    wire = 2 * (cp - 1) / cp * payload
    for rank, halves in enumerate(dist.run(cp, comm_body, mode)):
        forward, backward = halves["forward"], halves["backward"]
        assert forward["calls"] == moe_layers, (rank, forward)
        assert forward["payload_bytes"] / payload == 1.0, (rank, forward, payload)
        assert forward["wire_bytes"] / wire == 1.0, (rank, forward, wire)
        assert backward == {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0}, (rank, backward)
