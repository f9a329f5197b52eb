"""Outer-loop data parallelism through the Trainer (``parallel.dp_mode``), proven against single
processes.

``loom.parallel.outer`` is tested on its own in ``test_outer_loop.py``; here the trainer drives it:
each dp_replicate replica trains on its part of every global batch with no gradient reduction
across replicas, and every H inner steps the outer step merges the replicas. The references are
single-process trainers, one per replica, each fed exactly that replica's samples
(``_replica_trainers``), merged by an outer update written out in this file (torch's own
``SGD(nesterov=True)`` on the pseudo-gradient, or a plain mean), never by ``OuterLoop``.

Debug model (4 layers, dim 64), 32-token rows, global batch 8, fp32, gloo.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import from_dict, resolve
from loom.data.loader import DistributedLoader
from loom.parallel.expert import expert_parameter_names
from loom.testing.parity import layout_config
from loom.train import full_state
from loom.train.checkpoint import CheckpointError
from loom.train.resume_checks import model_shape_refusal
from loom.train.trainer import Trainer
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.data_fixtures import prepared_documents

GLOBAL_BATCH = 8
REPLICAS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.global_batch_size": GLOBAL_BATCH,
        "train.micro_batch_size": 2, "optim.warmup_steps": 2, "optim.lr": 3e-3,
        "train.eval_every": 0, "train.grad_clip": 1.0}
# The replica trainers of the reference run the same operations on the same samples as the
# ranks, and torch's SGD rounds as OuterLoop does: measured, DiLoCo's weights are bit-identical.
# The logged loss is the replicas' mean, in fp32 on the ranks and in float64 here: 1 ulp of ~5.
LOSS_RTOL, LOSS_ATOL = 1e-6, 1e-6


def outer_config(world: int, mode: str, **parallel) -> dict:
    return layout_config({**BASE, "parallel.dp_mode": mode}, world,
                         **{"dp_replicate": REPLICAS, **parallel})


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's replica's whole model by name: DTensors gathered (collectives over tp or
    dp_shard), experts over ep, then the pipeline stages (over pp; vocabulary rows in order)."""
    return full_state.named_weights(trainer)


def train(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """Train ``steps`` steps; the logged losses, this rank's replica, its final weights and its
    last step's gradients (as this rank holds them, before any outer step)."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"loss": losses, "replica": trainer.replica, "weights": full_weights(trainer),
            "grads": grads}


# -- the single-process reference ----------------------------------------------------------------
def _replica_trainers(ctx, config_table: dict, data_dir: str) -> list[Trainer]:
    """One single-process trainer per replica, trainer r fed replica r's part of every global
    batch: its config has the replica's batch (the schedule's microbatch count), its loader the
    sampler of the whole global batch, cut at dp rank r of REPLICAS."""
    single = dict(config_table)
    single["parallel"] = {**config_table["parallel"], "dp_replicate": 1, "dp_mode": "sync"}
    single["train"] = {**config_table["train"],
                       "global_batch_size": GLOBAL_BATCH // REPLICAS}
    trainers = []
    for r in range(REPLICAS):
        trainer = Trainer(from_dict(single), Path(data_dir), None, ctx)
        sampler = trainer.data.sampler(trainer.train_set, GLOBAL_BATCH, trainer.config.train.seed)
        trainer.loader = DistributedLoader(trainer.train_set, sampler, r, REPLICAS,
                                           trainer.ctx.device)
        trainers.append(trainer)
    return trainers


def reference(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """The replicas as independent single-process trainers; every H steps the outer update of
    DiLoCo (torch's SGD with Nesterov momentum on the mean pseudo-gradient) or of NoLoCo with
    two replicas, consensus 1, outer lr 1 and no momentum (the pair's mean, by hand). With bf16
    parameters (``train.dtype = bf16``) the update merges their fp32 masters, which AdamW
    steps, and every parameter restarts at its master's bf16 rounding."""
    from loom.parallel.mixed_precision import MASTER

    par = config_table["parallel"]
    bf16 = config_table["train"].get("dtype") == "bf16"
    trainers = _replica_trainers(ctx, config_table, data_dir)
    names = [n for n, _ in trainers[0].model.named_parameters()]
    params = [dict(t.model.named_parameters()) for t in trainers]

    def stepped(param: nn.Parameter) -> torch.Tensor:  # what the inner optimizer steps
        return getattr(param, MASTER) if bf16 else param

    # the outer weights phi, stepped by torch's SGD (foreach off: one tensor at a time)
    phi = {n: nn.Parameter(stepped(params[0][n]).detach().clone()) for n in names}
    mu = par["outer_momentum"]
    outer = torch.optim.SGD(list(phi.values()), lr=par["outer_lr"], momentum=mu,
                            nesterov=mu > 0, foreach=False)
    losses = []
    for step in range(1, steps + 1):
        losses.append(sum(t.train_step()["loss"] for t in trainers) / REPLICAS)
        if step % par["outer_steps"]:
            continue
        with torch.no_grad():
            if par["dp_mode"] == "noloco":  # one averaging step of the (only) pair
                assert (par["outer_lr"], mu) == (1.0, 0.0)
                for n in names:
                    phi[n].copy_(sum(stepped(p[n]) for p in params) / REPLICAS)
            else:
                for n in names:
                    phi[n].grad = sum(phi[n] - stepped(p[n]) for p in params) / REPLICAS
                outer.step()
            for p in params:
                for n in names:
                    stepped(p[n]).copy_(phi[n])
                    p[n].copy_(phi[n])  # bf16: the master's rounding
    out = {"loss": losses, "weights": [{n: p[n].detach().clone() for n in names}
                                       for p in params]}
    if bf16:
        out["masters"] = [{n: stepped(p[n]).detach().clone() for n in names} for p in params]
    return out


def assert_matches(results: list[dict], expected: dict, label: str, rtol: float, atol: float
                   ) -> None:
    """Every rank's logged losses and its replica's weights against the expected ones (the
    tolerances: 0 asks for bit-identical weights)."""
    for rank, got in enumerate(results):
        where = f"{label} rank {rank} (replica {got['replica']})"
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(expected["loss"]),
                                   rtol=max(rtol, LOSS_RTOL), atol=max(atol, LOSS_ATOL),
                                   msg=lambda m: f"{where} loss: {m}")
        want = expected["weights"][got["replica"]]
        assert set(got["weights"]) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got["weights"][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{where} {n}: {m}")


# -- (a) DiLoCo with H = 1, outer lr 1 and no momentum is synchronous data parallelism ----------
# ... when the inner step is linear in the gradient. AdamW is not (averaging weights after an
# AdamW step is not averaging gradients before it: test_outer_loop.py shows the difference), so
# this test puts AdamW in its linear limit: an eps so large that sqrt(v) + eps == eps exactly in
# fp32 (gradients here are < 10, the spacing of fp32 numbers near 1e9 is 64), no weight decay,
# lr / eps = 0.05: momentum SGD with Adam's bias-corrected first moment. Clipping is off (sync
# clips the mean gradient, the replicas their own).
LINEAR_ADAMW = {"optim.eps": 1e9, "optim.lr": 5e7, "optim.weight_decay": 0.0,
                "train.grad_clip": 0.0}


def test_diloco_h1_outer_lr1_no_momentum_equals_synchronous_data_parallelism(dist,
                                                                             small_data_dir):
    steps = 4
    base = {**BASE, **LINEAR_ADAMW}
    sync = dist.run(2, train, layout_config(base, 2, dp_replicate=2), small_data_dir, steps)
    diloco = dist.run(2, train, layout_config(
        {**base, "parallel.dp_mode": "diloco", "parallel.outer_steps": 1,
         "parallel.outer_lr": 1.0, "parallel.outer_momentum": 0.0}, 2, dp_replicate=2),
        small_data_dir, steps)
    # Measured: the two differ by rounding only (the mean of two updates vs the update of the
    # mean gradient), <= 3.6e-7 on weights up to 1.0 after 4 steps; the losses are identical.
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(diloco[rank]["loss"]),
                                   torch.tensor(sync[rank]["loss"]), rtol=1e-6, atol=1e-6)
        for name, value in sync[rank]["weights"].items():
            torch.testing.assert_close(diloco[rank]["weights"][name], value, rtol=1e-6,
                                       atol=1e-6, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    assert sync[0]["loss"][-1] < sync[0]["loss"][0] - 0.05  # it trained
    # ... and not because the gradients were still averaged across the replicas: under diloco
    # each replica keeps its own, under sync they are the same on both
    assert all(torch.equal(sync[0]["grads"][n], sync[1]["grads"][n]) for n in sync[0]["grads"])
    assert max((diloco[0]["grads"][n] - diloco[1]["grads"][n]).abs().max()
               for n in diloco[0]["grads"]) > 1e-3


# -- a non-finite gradient in one replica -----------------------------------------------------
def train_with_one_replica_blowing_up(ctx, config_table: dict, data_dir: str) -> dict:
    """Two steps; in the first, replica 1's gradients are infinite (its loss is finite)."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    first = next(p for p in trainer.model.parameters() if p.requires_grad)
    handle = first.register_hook(lambda g: g * float("inf")) if trainer.replica == 1 else None
    losses = [trainer.train_step()["loss"]]
    if handle is not None:
        handle.remove()
    losses.append(trainer.train_step()["loss"])
    return {"skipped": trainer.skipped_steps, "losses": losses}


def test_a_non_finite_norm_in_one_replica_skips_the_step_in_every_replica(dist, small_data_dir):
    """Each replica's gradient norm is its own, so without agreement replica 0 would step and
    replica 1 skip (or, with nonfinite = stop, stop alone and leave replica 0 waiting)."""
    table = outer_config(2, "diloco", **{})
    table["train"] = {**table["train"], "nonfinite": "skip"}
    results = dist.run(2, train_with_one_replica_blowing_up, table, small_data_dir)
    assert [r["skipped"] for r in results] == [1, 1]
    for r in results:
        assert math.isnan(r["losses"][0]) and math.isfinite(r["losses"][1])


# -- (b) NoLoCo with every replica paired and full averaging is one averaging step ---------------
def test_noloco_full_averaging_is_one_averaging_step_of_the_replicas(dist, small_data_dir):
    """Two replicas (always one pair), consensus 1, outer lr 1, no momentum: after H = 2 local
    steps each replica holds the mean of the two single-process runs' weights."""
    steps = 2
    config = outer_config(2, "noloco", outer_steps=2, outer_lr=1.0, outer_momentum=0.0)
    results = dist.run(2, train, config, small_data_dir, steps)
    expected = dist.run(1, reference, config, small_data_dir, steps)[0]
    # before the step the replicas had moved apart; after it they agree to rounding (NoLoCo
    # forms phi - ((1 + c) phi - theta_i + s_p) / 2, not (theta_0 + theta_1) / 2): measured
    # 1.2e-7, one ulp of the largest weights (~1)
    assert_matches(results, expected, "noloco", rtol=1e-6, atol=1e-6)
    for name, value in results[0]["weights"].items():
        torch.testing.assert_close(results[1]["weights"][name], value, rtol=1e-6, atol=1e-6)
    assert max((a - b).abs().max() for a, b in zip(results[0]["grads"].values(),
                                                   results[1]["grads"].values())) > 1e-3


def outer_settings(ctx, config_table: dict, data_dir: str) -> dict:
    """What the trainer's outer loop was built with."""
    outer = Trainer(from_dict(config_table), Path(data_dir), None, ctx).outer
    return {"consensus": outer.noloco_consensus, "nesterov": outer.nesterov}


def test_the_configured_noloco_consensus_and_momentum_form_reach_the_outer_loop(
        dist, small_data_dir):
    """``parallel.noloco_consensus`` is the outer loop's c (its effect on one step is worked by
    hand in test_outer_loop.py), and NoLoCo steps by heavy ball, as its authors' code."""
    config = outer_config(2, "noloco", outer_steps=2)
    config["parallel"]["noloco_consensus"] = 0.25
    assert dist.run(2, outer_settings, config, small_data_dir) == \
        [{"consensus": 0.25, "nesterov": False}] * 2


# -- (c) DiLoCo H = 4 against two single processes and torch's Nesterov SGD ----------------------
@pytest.mark.parametrize("steps, options", [
    (8, dict(outer_steps=4, outer_lr=0.7, outer_momentum=0.9)),  # two outer steps: momentum
])
def test_diloco_equals_independent_replicas_merged_by_nesterov_sgd(dist, small_data_dir, steps,
                                                                     options):
    config = outer_config(2, "diloco", **options)
    results = dist.run(2, train, config, small_data_dir, steps)
    expected = dist.run(1, reference, config, small_data_dir, steps)[0]
    assert_matches(results, expected, "diloco", rtol=0, atol=0)  # bit-identical weights
    # the replicas are identical after the last outer step (step 8), and had diverged before it
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name
    assert max((a - b).abs().max() for a, b in zip(results[0]["grads"].values(),
                                                   results[1]["grads"].values())) > 1e-3


def merged_replicas_differ_from_one_replica(ctx, config_table, data_dir, steps):
    """Guard for (c): the reference's outer update matters (the replicas' own runs differ from
    the merged weights), so matching it is not matching two unmerged runs."""
    trainers = _replica_trainers(ctx, config_table, data_dir)
    for _ in range(steps):
        for trainer in trainers:
            trainer.train_step()
    return [dict(t.model.named_parameters()) for t in trainers]


def test_the_outer_step_changes_the_weights(dist, small_data_dir):
    config = outer_config(2, "diloco", outer_steps=4, outer_lr=0.7, outer_momentum=0.9)
    merged = dist.run(1, reference, config, small_data_dir, 4)[0]["weights"][0]
    alone = dist.run(1, merged_replicas_differ_from_one_replica, config, small_data_dir, 4)[0]
    for replica in alone:
        assert max((merged[n] - replica[n]).abs().max() for n in merged) > 1e-3


# -- composition: the outer loop over replicas that are themselves split ------------------------
INSIDE = [
    dict(dp_shard=2, zero_stage=3),  # ZeRO-3 (FSDP2) inside each replica: no HSDP across them
    # ZeRO-1/2: each rank merges only the slices its optimizer owns, then re-gathers them
    dict(dp_shard=2, zero_stage=1),
    dict(dp_shard=2, zero_stage=2),
    dict(tp=2, sequence_parallel=True),
    dict(pp=2, schedule="1f1b"),
    # the embedding and the head split over the pipeline's ranks: each merges its own rows
    dict(pp=2, schedule="1f1b", vocab_parallel_pp=True),
    dict(pp=2, schedule="1f1b", vocab_parallel_pp=True, dp_shard=2, zero_stage=1),
    dict(pp=2, schedule="1f1b", vocab_parallel_pp=True, dp_shard=2, zero_stage=3),
]


# CI: all but ZeRO-2 (ZeRO-1 takes the same slice path), ZeRO-3 under vocabulary pp and tp
@pytest.mark.parametrize("layout", matrix(INSIDE, ci=[
    c for c in INSIDE if c.get("zero_stage") != 2 and "tp" not in c
    and not (c.get("vocab_parallel_pp") and c.get("zero_stage") == 3)]),
                         ids=["zero3", "zero1", "zero2", "tp2-sp", "pp2", "pp2-vocab",
                              "pp2-vocab-zero1", "pp2-vocab-zero3"])
def test_diloco_composes_with_a_layout_inside_each_replica(dist, small_data_dir, layout):
    """dp_replicate = 2 replicas of 2 ranks each equal dp_replicate = 2 replicas of one rank
    (which (c) proves against single processes), to the layouts' own parity tolerance."""
    steps, options = 6, dict(outer_steps=3, outer_lr=0.7, outer_momentum=0.9)
    plain = dist.run(2, train, outer_config(2, "diloco", **options), small_data_dir, steps)
    world = REPLICAS * math.prod(layout.get(axis, 1) for axis in ("dp_shard", "tp", "pp"))
    split = dist.run(world, train, outer_config(world, "diloco", **options, **layout),
                     small_data_dir, steps)
    expected = {"loss": plain[0]["loss"], "weights": {r["replica"]: r["weights"] for r in plain}}
    # the layouts' parity with one process (test_zero.py, test_tensor_parallel.py, ...):
    # summation order only, carried through AdamW
    assert_matches(split, expected, f"diloco {layout}", rtol=1e-4, atol=1e-5)


MOE = {"model.n_experts": 4}


EXPERT_LAYOUTS = [dict(ep=2), dict(ep=2, cp=2),
                  # ZeRO on the replica's dp_shard x ep (dense) and dp_shard (experts) only
                  dict(ep=2, dp_shard=2, zero_stage=1), dict(ep=2, dp_shard=2, zero_stage=3)]


@pytest.mark.parametrize("layout", matrix(EXPERT_LAYOUTS, ci=[dict(ep=2),
                                                             dict(ep=2, dp_shard=2, zero_stage=3)]),
                         ids=["ep2", "ep2-cp2", "ep2-zero1", "ep2-zero3"])
def test_diloco_composes_with_expert_parallelism_inside_each_replica(dist, small_data_dir,
                                                                     layout):
    """An MoE model: replicas of ep = 2 (dense gradients averaged over the replica's ep ranks,
    experts' kept per ep rank; with cp = 2 over ep x cp, experts' over cp; with ZeRO-1 or
    ZeRO-3 on dp_shard = 2, sharded inside the replica) equal replicas of one rank, whose
    outer step merges every expert too (the dp_replicate group pairs the same ep coordinate,
    so the same experts)."""
    steps = 4
    options = dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    world = REPLICAS * math.prod(layout.get(axis, 1) for axis in ("ep", "cp", "dp_shard"))
    # one sequence per microbatch: 8 data ranks (2 replicas x dp_shard 2 x ep 2) share 8
    configs = [layout_config({**BASE, **MOE, "parallel.dp_mode": "diloco",
                              "train.micro_batch_size": 1 if "dp_shard" in layout else 2}, n,
                             **{"dp_replicate": REPLICAS, **options, **extra})
               for n, extra in ((2, {}), (world, layout))]
    plain = dist.run(2, train, configs[0], small_data_dir, steps)
    split = dist.run(world, train, configs[1], small_data_dir, steps)
    expected = {"loss": plain[0]["loss"], "weights": {r["replica"]: r["weights"] for r in plain}}
    assert_matches(split, expected, f"diloco moe {layout}", rtol=1e-4, atol=1e-5)


# -- bf16 parameters (train.dtype = bf16): the outer loop merges the fp32 masters ---------------
def train_bf16(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``train`` with bf16 parameters, plus this rank's fp32 masters where the parameters keep
    them (layouts without ZeRO and tensor parallelism)."""
    from loom.parallel.mixed_precision import MASTER

    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return {"loss": losses, "replica": trainer.replica, "weights": full_weights(trainer),
            "masters": {n: getattr(p, MASTER).detach().clone()
                        for n, p in trainer.model.named_parameters() if hasattr(p, MASTER)}}


def test_bf16_diloco_equals_bf16_replicas_whose_masters_are_merged(dist, small_data_dir):
    """Two bf16 replicas of one rank against two single-process bf16 trainers merged by
    torch's Nesterov SGD on their fp32 masters: the same arithmetic, so masters and bf16
    parameters are bit-identical. Merging the bf16 values instead loses every inner update
    below bf16's resolution."""
    steps = 4
    config = outer_config(2, "diloco", outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    config["train"] = {**config["train"], "dtype": "bf16"}
    results = dist.run(2, train_bf16, config, small_data_dir, steps)
    expected = dist.run(1, reference, config, small_data_dir, steps)[0]
    assert_matches(results, expected, "bf16 diloco", rtol=0, atol=0)
    for got in results:
        want = expected["masters"][got["replica"]]
        assert set(got["masters"]) == set(want) and got["masters"]
        for name, value in want.items():
            assert value.dtype == torch.float32
            assert torch.equal(got["masters"][name], value), f"replica {got['replica']} {name}"
        assert all(w.dtype == torch.bfloat16 for w in got["weights"].values())


BF16_INSIDE = [dict(dp_shard=2, zero_stage=1), dict(dp_shard=2, zero_stage=3),
               dict(tp=2, sequence_parallel=True), dict(pp=2, schedule="1f1b")]


# CI: ZeRO-1, whose outer loop merges the fp32 master slices and re-gathers them in bf16
@pytest.mark.parametrize("layout", matrix(BF16_INSIDE, ci=[BF16_INSIDE[0]]),
                         ids=["zero1", "zero3", "tp2-sp", "pp2"])
def test_bf16_diloco_composes_with_a_layout_inside_each_replica(dist, small_data_dir, layout):
    """bf16 replicas of 2 ranks each against bf16 replicas of one rank (proven above).

    bf16 layouts do not agree bit for bit: summation order moves a gradient by one bf16
    rounding, and AdamW turns that into up to about lr per step on an element (measured over
    these 4 steps: weights up to 0.011 apart under tp2 x SP, 0.0005 under ZeRO-1; losses up to
    3e-4 apart, 6e-5 relative). So the merge is checked where it is exact: after the last outer
    step the two replicas hold bit-identical weights on every rank (a merge that missed a
    slice, or a re-gather that did not happen, leaves each replica its own inner steps); and the
    losses after the first merge follow the one-rank replicas to rtol 2e-4 (a wrong merge moves
    them by the outer step, ~1e-2 relative)."""
    steps, options = 4, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    world = REPLICAS * math.prod(layout.get(axis, 1) for axis in ("dp_shard", "tp", "pp"))
    configs = []
    for n, extra in ((2, {}), (world, layout)):
        table = outer_config(n, "diloco", **options, **extra)
        table["train"] = {**table["train"], "dtype": "bf16"}
        configs.append(table)
    plain = dist.run(2, train, configs[0], small_data_dir, steps)
    split = dist.run(world, train, configs[1], small_data_dir, steps)
    lr_bound = 2 * BASE["optim.lr"] * steps
    for rank, got in enumerate(split):
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(plain[0]["loss"]),
                                   rtol=2e-4, atol=0, msg=lambda m: f"rank {rank} loss: {m}")
        for name, value in split[0]["weights"].items():
            assert torch.equal(got["weights"][name], value), f"rank {rank} {name}"
            torch.testing.assert_close(value.float(), plain[0]["weights"][name].float(),
                                       rtol=0, atol=lr_bound, msg=lambda m, n=name: f"{n}: {m}")
    assert {got["replica"] for got in split} == {0, 1}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[str, dict]:
    """Short documents of very different lengths (``tests/dist/test_documents_axes.py``'s)."""
    return prepared_documents(tmp_path_factory, "outer_docs", 32, count=400, seed=29)


@pytest.mark.parametrize("packing", matrix(["pack", "varlen", "varlen-zeppelin"],
                                            ci=["pack", "varlen-zeppelin"]))
def test_diloco_composes_with_documents_under_cp_inside_each_replica(dist, short_documents,
                                                                     packing):
    """Documents cut over cp = 2 inside each replica (ranks holding unequal real tokens): the
    step's tokens counted over the replica's cp ranks (never across replicas) give replicas of
    two ranks equal to replicas of one; so does Zeppelin's placement over each replica's cp
    ranks (its microbatches are ``tokens``' deal, the replicas of one rank's balance)."""
    data_dir, docs = short_documents
    varlen = {"data.packing": "varlen", "data.tokens_per_microbatch": 48,
              "train.global_batch_tokens": 4 * 48}
    per_packing = {"pack": ({"data.packing": "pack", "train.global_batch_size": 8,
                             "train.micro_batch_size": 2}, {}),
                   "varlen": (varlen, {}),
                   "varlen-zeppelin": ({**varlen, "data.balance": "tokens"},
                                       {"data.balance": "zeppelin"})}[packing]
    options = dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    configs = [layout_config({**docs, "model.preset": "debug", **per_packing[0], **split_data,
                              "parallel.dp_mode": "diloco"}, n,
                             **{"dp_replicate": REPLICAS, **options, **extra})
               for n, extra, split_data in ((2, {}, {}), (4, dict(cp=2), per_packing[1]))]
    plain = dist.run(2, train, configs[0], data_dir, 4)
    split = dist.run(4, train, configs[1], data_dir, 4)
    expected = {"loss": plain[0]["loss"], "weights": {r["replica"]: r["weights"] for r in plain}}
    assert_matches(split, expected, f"diloco {packing} cp2", rtol=1e-4, atol=1e-5)


# -- (d) checkpoints hold the outer state and resume bit-exactly --------------------------------
def straight_and_resumed(ctx, config_table: dict, data_dir: str, run_dir: str, steps: int,
                         stop: int) -> dict:
    """Losses and weights of ``steps`` steps straight, and of a run stopped after ``stop`` steps
    (a checkpoint), resumed by a new Trainer and finished; and whether a resume under dp_mode =
    sync is refused by name."""
    config = from_dict(config_table)
    straight = Trainer(config, Path(data_dir), None, ctx)
    straight_losses = [straight.train_step()["loss"] for _ in range(steps)]
    straight_weights = full_weights(straight)
    del straight

    first = Trainer(config, Path(data_dir), run_dir, ctx)
    losses = [first.train_step()["loss"] for _ in range(stop)]
    at_stop = full_weights(first)
    first.save_checkpoint()
    del first
    second = Trainer(config, Path(data_dir), run_dir, ctx)
    second.resume("auto", log=lambda msg: None)
    assert second.step == stop and second.outer.inner_steps == stop
    losses += [second.train_step()["loss"] for _ in range(steps - stop)]

    sync_table = {**config_table, "parallel": {**config_table["parallel"], "dp_mode": "sync"}}
    refused = ""
    try:
        Trainer(from_dict(sync_table), Path(data_dir), run_dir, ctx).resume("auto",
                                                                            log=lambda m: None)
    except CheckpointError as err:
        refused = str(err)
    return {"straight": (straight_losses, straight_weights),
            "resumed": (losses, full_weights(second)), "at_stop": at_stop, "refused": refused,
            "replica": second.replica}


RESUMES = [
    ("diloco", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)),
    ("diloco", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9, dp_shard=2,
                    zero_stage=3)),
    ("co2", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9, co2_clip=0.01, dp_shard=2,
                 zero_stage=1)),
    ("diloco", dict(outer_steps=4, outer_lr=0.7, outer_momentum=0.9, outer_fragments=2)),
    ("noloco", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)),
    ("co2", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9, co2_clip=0.01)),
]


# matrix: ZeRO-3 inside the replicas (its resume runs in tests/dist/test_checkpoint_resume.py)
# and CO2 over ZeRO-1's slices; CI: streaming DiLoCo (its fragments hold plain DiLoCo's state
# and more), NoLoCo, CO2
@pytest.mark.parametrize("mode, options", matrix(RESUMES, ci=[RESUMES[i] for i in (3, 4, 5)]),
                         ids=["diloco", "diloco-zero3", "co2-zero1", "diloco-streaming", "noloco",
                              "co2"])
def test_checkpoint_resume_is_bit_exact(dist, small_data_dir, tmp_path, mode, options):
    # stop at 5: after outer steps have built momentum (co2: an average in flight; streaming:
    # one fragment merged since the other), in the middle of a window
    steps, stop = 8, 5
    world = 2 * options.get("dp_shard", 1)
    results = dist.run(world, straight_and_resumed, outer_config(world, mode, **options),
                       small_data_dir, str(tmp_path), steps, stop)
    for rank, result in enumerate(results):
        (want_losses, want), (got_losses, got) = result["straight"], result["resumed"]
        assert got_losses == want_losses, f"rank {rank}: {got_losses} != {want_losses}"
        assert all(torch.equal(got[n], want[n]) for n in want), f"rank {rank}: weights differ"
        assert "dp_mode=" in result["refused"], result["refused"]
    # the replicas held different weights when the checkpoint was written (the middle of a
    # window), so resuming both bit-exactly needs both copies in it
    at_stop = {result["replica"]: result["at_stop"] for result in results}
    assert any(not torch.equal(at_stop[0][n], at_stop[1][n]) for n in at_stop[0])


@pytest.mark.matrix  # CI: co2's resume in fp32 (the outer state is fp32 in both) and the
# bf16 checkpoints' masters (tests/dist/test_bf16_master.py)
def test_a_bf16_replica_resumes_bit_exactly(dist, small_data_dir, tmp_path):
    """CO2 (the most outer state: momentum, displacement, an average in flight) over bf16
    parameters: the checkpoint's fp32 masters and the outer state resume both replicas bit for
    bit in the middle of a window."""
    config = outer_config(2, "co2", outer_steps=2, outer_lr=0.7, outer_momentum=0.9,
                          co2_clip=0.01)
    config["train"] = {**config["train"], "dtype": "bf16"}
    results = dist.run(2, straight_and_resumed, config, small_data_dir, str(tmp_path), 8, 5)
    for rank, result in enumerate(results):
        (want_losses, want), (got_losses, got) = result["straight"], result["resumed"]
        assert got_losses == want_losses, f"rank {rank}: {got_losses} != {want_losses}"
        assert all(w.dtype == torch.bfloat16 for w in want.values())
        assert all(torch.equal(got[n], want[n]) for n in want), f"rank {rank}: weights differ"
    at_stop = {result["replica"]: result["at_stop"] for result in results}
    assert any(not torch.equal(at_stop[0][n], at_stop[1][n]) for n in at_stop[0])


def _outer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The outer loop's snapshot and momentum, full tensors by name (collective under ZeRO and
    ep): ZeRO-1/2's slices gathered and cut by name, ZeRO-3's shards gathered, then the experts'
    entries stacked back over ep."""
    state = trainer.outer.state_dict()
    if trainer.zero is not None:  # ZeRO-1/2: the optimizer's slices, gathered and cut by name
        out = {}
        for key in ("snapshot", "momentum"):
            for i, bucket in enumerate(trainer.zero.buckets):
                slice_ = state[key][f"zero.bucket{i}"].contiguous()
                full = slice_.new_empty(bucket.flat.numel())
                torch_dist.all_gather_into_tensor(full, slice_, group=bucket.shards.group)
                for name, param in zip(bucket.names, bucket.params):
                    at = bucket.offsets[id(param)]
                    out[f"{key}/{name}"] = full[at:at + param.numel()].view(param.shape).cpu()
    else:
        out = {f"{key}/{name}": (v.full_tensor() if isinstance(v, DTensor) else v).cpu().clone()
               for key in ("snapshot", "momentum") for name, v in state[key].items()}
    if trainer.ep is not None:  # the experts' entries stacked back over ep (collective)
        for key in ("snapshot", "momentum"):
            for name in sorted(expert_parameter_names(trainer.model)):
                local = out[f"{key}/{name}"].contiguous()
                full = local.new_empty((local.shape[0] * trainer.ep.size, *local.shape[1:]))
                torch_dist.all_gather_into_tensor(full, local, group=trainer.ep.group)
                out[f"{key}/{name}"] = full
    return out


def save_after(ctx, config_table: dict, data_dir: str, root: str, steps: int) -> dict:
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    for _ in range(steps):
        trainer.train_step()
    path = trainer.save_checkpoint(Path(root))
    return {"path": str(path), "replica": trainer.replica, "weights": full_weights(trainer),
            "outer": _outer_state(trainer)}


def load_into(ctx, config_table: dict, data_dir: str, path: str) -> dict:
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    trainer.load_checkpoint(Path(path))
    return {"replica": trainer.replica, "weights": full_weights(trainer),
            "outer": _outer_state(trainer), "inner_steps": trainer.outer.inner_steps}


def test_checkpoint_reshards_inside_each_replica(dist, small_data_dir, tmp_path):
    """Saved by replicas of one rank, loaded by replicas of two (ZeRO-3 over dp_shard): each
    replica gets its own weights and outer state back, bit for bit (DCP reshards by name inside
    the replica's keys)."""
    options = dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    saved = dist.run(2, save_after, outer_config(2, "diloco", **options), small_data_dir,
                     str(tmp_path), 5)
    loaded = dist.run(4, load_into, outer_config(4, "diloco", dp_shard=2, zero_stage=3,
                                                 **options), small_data_dir, saved[0]["path"])
    by_replica = {s["replica"]: s for s in saved}
    assert any(not torch.equal(saved[0]["weights"][n], saved[1]["weights"][n])
               for n in saved[0]["weights"])  # mid-window: the replicas' weights differ
    for rank, got in enumerate(loaded):
        want = by_replica[got["replica"]]
        assert got["inner_steps"] == 5
        for part in ("weights", "outer"):
            assert set(got[part]) == set(want[part])
            assert all(torch.equal(got[part][n], want[part][n]) for n in want[part]), \
                f"rank {rank} {part}"


@pytest.mark.parametrize("layout", matrix([dict(ep=2), dict(ep=2, dp_shard=2, zero_stage=3),
                                           dict(ep=2, dp_shard=2, zero_stage=1)],
                                          ci=[dict(ep=2)]), ids=["ep2", "ep2-zero3", "ep2-zero1"])
def test_an_expert_parallel_replica_resumes_and_reshards(dist, small_data_dir, tmp_path, layout):
    """Replicas of ep = 2 (an MoE model; with ZeRO-3 or ZeRO-1 on dp_shard = 2 too): stopped
    mid-window and resumed, they end bit-identical to a run that did not stop; saved, they load
    into replicas of one rank with every weight and the outer snapshot and momentum bit for bit
    (the experts' outer state is saved as each ep rank's box of the global tensor, as the
    weights are; under ZeRO-1 as the optimizer's slices)."""
    options = dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)

    def config(world: int, **extra) -> dict:
        return layout_config({**BASE, **MOE, "parallel.dp_mode": "diloco",
                              "train.micro_batch_size": 1 if "dp_shard" in layout else 2}, world,
                             **{"dp_replicate": REPLICAS, **options, **extra})

    world = REPLICAS * math.prod(layout.get(axis, 1) for axis in ("ep", "dp_shard"))
    results = dist.run(world, straight_and_resumed, config(world, **layout), small_data_dir,
                       str(tmp_path / "resume"), 6, 3)
    for rank, result in enumerate(results):
        (want_losses, want), (got_losses, got) = result["straight"], result["resumed"]
        assert got_losses == want_losses, f"rank {rank}: {got_losses} != {want_losses}"
        assert all(torch.equal(got[n], want[n]) for n in want), f"rank {rank}: weights differ"
    saved = dist.run(world, save_after, config(world, **layout), small_data_dir,
                     str(tmp_path / "save"), 3)
    loaded = dist.run(2, load_into, config(2), small_data_dir, saved[0]["path"])
    # names under replica<r>., the experts at their full shapes: loom train's check accepts it
    assert model_shape_refusal(resolve(from_dict(config(2)), 2), Path(saved[0]["path"])) is None
    by_replica = {s["replica"]: s for s in saved}
    for rank, got in enumerate(loaded):
        want = by_replica[got["replica"]]
        for part in ("weights", "outer"):
            assert set(got[part]) == set(want[part])
            assert all(torch.equal(got[part][n], want[part][n]) for n in want[part]), \
                f"rank {rank} {part}"


def test_a_zero1_replica_checkpoint_reshards_to_one_rank_replicas(dist, small_data_dir, tmp_path):
    """Saved by replicas of two ZeRO-1 ranks (the outer state held as the optimizer's slices),
    loaded by replicas of one rank: every weight and the outer snapshot and momentum, bit for
    bit, by parameter name."""
    options = dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    saved = dist.run(4, save_after, outer_config(4, "diloco", dp_shard=2, zero_stage=1,
                                                 **options), small_data_dir, str(tmp_path), 5)
    loaded = dist.run(2, load_into, outer_config(2, "diloco", **options), small_data_dir,
                      saved[0]["path"])
    for rank, got in enumerate(loaded):
        want = next(s for s in saved if s["replica"] == got["replica"])
        assert set(got["weights"]) == set(want["weights"])
        assert all(torch.equal(got["weights"][n], want["weights"][n]) for n in want["weights"])
        assert set(got["outer"]) == set(want["outer"])
        assert all(torch.equal(got["outer"][n], want["outer"][n]) for n in want["outer"]), rank
