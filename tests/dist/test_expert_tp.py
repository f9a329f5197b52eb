"""MoE under tensor parallelism (expert-TP = TP), alone and with expert and data parallelism.

Parity through the real ``Trainer`` (``loom.testing.parity``): the ``tiny-moe`` model (1 dense + 3
MoE layers, 4 experts top-2, one shared expert), same seed and data, 2 AdamW steps in fp32 with
global-norm clipping, on one process and on tp2, tp2+SP, ep2 x tp2 (with and without SP, dropless
and with a capacity factor that drops assignments) and ep2 x tp2 x dp2 on 8 ranks. Loss, gradient
norm and every parameter's full gradient must match.

Communication: one forward + backward of a tp-parallel MoE model; the counted ``tp`` bytes equal
the dense formula of ``test_tensor_parallel.expected_tp_volume`` (an MoE block moves exactly what
the dense MLP moves: the same all-reduce, or all-gather + reduce-scatter under SP, each way) plus
one all-reduce of the combine weights' gradient per MoE layer in backward (A = B*S*k elements,
dropless). Ratio measured / formula exactly 1.00.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom.models import Transformer, TransformerArgs, reset_parameters
from loom.parallel.comm import CommLedger
from loom.parallel.tensor import TensorParallel, apply_tensor_parallel
from loom.testing.parity import assert_parity, layout_config, record_training
from loom.topology import RankGrid, build_mesh
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_tensor_parallel import expected_tp_volume

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "tiny-moe", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "optim.lr": 1e-3, "train.grad_clip": 1.0}
# Step 1 starts from identical weights: only the summation order differs (partial expert outputs
# summed by the all-reduce, dense gradients averaged over dp x ep). Later steps: Adam turns
# rounding-level gradient differences into ~lr weight differences (see test_data_parallel.py).
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5

SP = {"parallel.sequence_parallel": True}
LAYOUTS = {  # name: (world, degrees, extra overrides)
    "tp2": (2, {"tp": 2, "dp_replicate": 1}, {}),
    "tp2-sp": (2, {"tp": 2, "dp_replicate": 1}, SP),
    "ep2-tp2": (4, {"ep": 2, "tp": 2, "dp_replicate": 1}, {}),
    "ep2-tp2-sp": (4, {"ep": 2, "tp": 2, "dp_replicate": 1}, SP),
    "ep2-tp2-dp2": (8, {"ep": 2, "tp": 2, "dp_replicate": 2}, {}),
}
ROUTING = {"dropless": {}, "capacity-1.0": {"model.capacity_factor": 1.0}}
CASES = [(layout, "dropless") for layout in LAYOUTS] + [("ep2-tp2", "capacity-1.0"),
                                                         ("tp2-sp", "capacity-1.0")]


@pytest.fixture(scope="module")
def references(dist, small_data_dir):
    cache = {}

    def get(routing):
        if routing not in cache:
            config = layout_config({**BASE, **ROUTING[routing]}, 1)
            cache[routing] = dist.run(1, record_training, config, small_data_dir, STEPS)[0]
        return cache[routing]
    return get


def assert_layout_matches(dist, data_dir: str, reference: dict, world: int, degrees: dict,
                          overrides: dict, label: str) -> None:
    """Train the layout through the Trainer; every rank's record must equal ``reference``."""
    config = layout_config({**BASE, **overrides}, world, **degrees)
    for rank, result in enumerate(dist.run(world, record_training, config, data_dir, STEPS)):
        where = f"{label} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=where)
    assert reference["loss"][-1] < reference["loss"][0]  # the runs really train


@pytest.mark.parametrize("layout, routing", matrix(CASES, ci=[
    ("tp2", "dropless"), ("ep2-tp2-sp", "dropless"),
    ("ep2-tp2", "capacity-1.0")]), ids=[f"{a}-{b}" for a, b in CASES])
def test_moe_tensor_parallel_trainer_matches_one_process(dist, small_data_dir, references,
                                                         layout, routing):
    world, degrees, extra = LAYOUTS[layout]
    assert_layout_matches(dist, small_data_dir, references(routing), world, degrees,
                          {**ROUTING[routing], **extra}, f"{layout} {routing}")


# -- communication volume ----------------------------------------------------------------------
B, S = 2, 32
ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=128,
                       max_seq_len=S, n_experts=4, top_k=2, expert_ffn_dim=64,
                       n_shared_experts=1)  # both layers MoE, dropless


def comm_body(ctx, sp: bool, ep: int) -> dict:
    """One forward + backward on this rank's B sequences; the ledger's records of each half."""
    from loom.parallel.expert import apply_expert_parallel

    grid = RankGrid({"ep": ep, "tp": ctx.world_size // ep})
    meshes = build_mesh(grid, "cpu")
    ledger = CommLedger()
    model = Transformer(ARGS)
    reset_parameters(model, 1234)
    apply_tensor_parallel(model, meshes.root["tp"], sequence_parallel=sp, vocab_parallel=False,
                          ledger=ledger)
    apply_expert_parallel(model, meshes.root["ep"].get_group(), ledger=None)
    tp = TensorParallel(meshes.root["tp"], sp, False, ledger)
    g = torch.Generator().manual_seed(7 + grid.index(ctx.rank, "ep"))
    tokens = torch.randint(0, ARGS.vocab_size, (B, S + 1), generator=g)
    halves = {}
    with tp.counting():
        loss = tp.loss(model(tokens[:, :-1]), tokens[:, 1:]) + 0.1 * model.moe_aux_loss()
        halves["forward"] = {k: dataclasses.asdict(r) for k, r in ledger.records.items()}
        ledger.reset()
        loss.backward()
        halves["backward"] = {k: dataclasses.asdict(r) for k, r in ledger.records.items()}
    return halves


def expected_moe_tp_volume(t: int, sp: bool) -> dict:
    """(calls, wire elements) per (axis, op), forward and backward, for ``ARGS`` on B x S tokens.

    Every block, dense or MoE, moves the dense TP volume (Megatron §3.1; SP: Korthikanti §4.2.2):
    an MoE block gathers/reduces its input and output once each way, exactly like the dense MLP.
    The one addition: the combine weights' gradient is a partial sum on each tp rank (its partial
    expert outputs dotted with the output gradient) and is all-reduced, A = B*S*k elements per MoE
    layer in backward (dropless: every assignment kept).
    """
    volume = expected_tp_volume(t, ARGS.n_layers, B, S, ARGS.dim, sp, False)
    calls, elements = volume["backward"].get(("tp", "all_reduce"), (0, 0.0))
    moe_layers = sum(ARGS.moe_layer(i) for i in range(ARGS.n_layers))
    A = B * S * ARGS.top_k
    volume["backward"][("tp", "all_reduce")] = (calls + moe_layers,
                                                elements + moe_layers * A * 2 * (t - 1) / t)
    return volume


@pytest.mark.parametrize("world, ep, sp", [(2, 1, False), (2, 1, True), (4, 1, False),
                                           (4, 2, False), (4, 2, True)])
def test_moe_tensor_parallel_bytes_match_the_formula(dist, world, ep, sp):
    expected = expected_moe_tp_volume(world // ep, sp)
    want = {half: {key: (calls, 1.0) for key, (calls, _) in ops.items()}
            for half, ops in expected.items()}
    for rank, halves in enumerate(dist.run(world, comm_body, sp, ep)):
        # (calls, measured wire bytes / formula) per (axis, op); the formula counts fp32
        # elements; rounded to 12 digits, i.e. equal up to float summation order
        got = {half: {key: (r["calls"], round(r["wire_bytes"] / (expected[half][key][1] * 4), 12)
                            if key in expected[half] else r["wire_bytes"])
                      for key, r in records.items()} for half, records in halves.items()}
        assert got == want, f"rank {rank}: measured {got} != formula {want}"
