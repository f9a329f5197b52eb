"""bidirectional_v trains: two model copies, opposite V pipelines, one process's numbers.

Parity, as for every one-copy family in tests/dist/test_pipeline_parity.py (whose harness, model
and tolerances this reuses: debug preset with 8 layers, fp32, 2 steps, clipping at 1.0): for p in
{2, 4} x m in {p, 2p+1} and for pp2 x dp2 (m = 3 and 4 per pipeline), loss, gradient norm and
every parameter's gradient after each step, then the validation loss and the saved weights,
against one process with the same global batch. On top, what is particular to two copies:

* after every step, every rank holding a parameter (rank r and its mirror p-1-r, and their dp
  replicas) holds bit-identical weights and gradients (``torch.equal``), so the copy sum and the
  identical optimizer steps keep the copies one model; each parameter is held by exactly 2 x dp
  ranks (the norm, which matches one process's, counts it once);
* with tied embeddings (p2 m2, p4 m9, pp2 x dp2 m4): each copy's embedding and head sit on one
  rank and are one Parameter there, and the copy sum adds the two copies' shared weight: the
  same parity and bit-identical copies;
* the copy sum is counted in the comm ledger: 4·P_rank bytes per step on axis ``pp_copies`` (a
  2-rank ring: wire bytes = payload), one all-reduce per unit (a model stage, or a tied model's
  two ends);
* eager gradient synchronisation (``loom.pipeline.route_copies``): without a data-parallel
  reducer the units' sums start during the schedule, and the losses, norms, gradients and
  weights are bit-identical (``torch.equal``) to the end-of-step sum's (``eager = False``, one
  flat all-reduce), with the same bytes counted;
* a run stopped halfway and resumed from its checkpoint ends bit-identical to one that never
  stopped (the two copies load the same names), and a checkpoint saved under bidirectional_v
  loads into one process with bit-identical weights and optimizer state (each name saved once,
  no conflicting copies), and the other way;
* ``loom train --parallel.pp=2 --parallel.schedule=bidirectional_v`` runs from the command line;
* ``bitpipe`` (the same two copies in BitPipe's own order, full backwards) matches one process
  with bit-identical copies at p2 m4 and p4 m8 (two basic units each);
* compositions, against one process at the same tolerances: pp2 x tp2, pp2 x tp2 with a
  vocabulary-parallel tied head, pp2 x cp2, pp2 x dp_shard2 and pp2 x HSDP 2x2 (ZeRO-3,
  gathered across the step) on the debug model, and MoE (tiny-moe) at pp2, pp2 x ep2 dropless
  and with capacity drops (test_expert_tp.py's settings). The copy sum acts on each rank's
  local tensors; mirror ranks share their tp, cp, ep and dp coordinates, so the shards line
  up. ZeRO-1/2 (pp2 x dp_shard2, stages 1 and 2): the copy sum adds the reduced flat slices
  (4 bytes per slice element) and the norm leaves the copy-1 replicas' slices out (without that
  the norm is sqrt(2) too large at step 1); the copies' weights stay bit-identical. Also the
  post-validated optimizer step (pp2), whose norm leaves the replicas out the same way.

The one-process comparison uses test_pipeline_parity's tolerances and reasoning (step 1 rtol
1e-5 / atol 1e-6: only the accumulation order differs; later steps 1e-4 / 1e-5 for Adam's
amplification of rounding-level elements).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.testing.parity import layout_config
from tests.conftest import matrix
from tests.dist.test_checkpoint_resume import BASE as RESUME_BASE
from tests.dist.test_checkpoint_resume import check_reshard, check_resume
from tests.dist.test_pipeline_parity import (BASE, STEPS, check, loom, record_pipeline,
                                             reference_runs)

COPY_BASE = {**BASE, "metrics.comm": True}
LAYOUTS = {  # name -> (world size, microbatches per pipeline, parallel degrees)
    **{f"p{p}-m{m}": (p, m, {"pp": p}) for p in (2, 4) for m in (p, 2 * p + 1)},
    "p2-dp2-m4": (4, 4, {"pp": 2, "dp_replicate": 2}),
    "p2-dp2-m3": (4, 3, {"pp": 2, "dp_replicate": 2}),  # odd: the copies' shares differ
}
# bitpipe (BitPipe's own order, full backwards): m a multiple of p, units of p/2 down, p/2 up
BITPIPE_LAYOUTS = {"bitpipe-p2-m4": (2, 4, {"pp": 2}), "bitpipe-p4-m8": (4, 8, {"pp": 4})}
TIED_BASE = {**COPY_BASE, "model.tie_embeddings": True}
TIED_LAYOUTS = ["p2-m2", "p4-m9", "p2-dp2-m4"]


def copies(trainer) -> dict:
    """After a step: this rank's weights and gradients by global name (CPU clones), the number
    of parameter elements it holds, and the copy sum's counted bytes (then the ledger is reset)."""
    params = dict(trainer.model.named_parameters())
    record = trainer.ledger.get("pp_copies", "all_reduce")
    observed = {
        "weights": {k: p.detach().cpu().clone() for k, p in params.items()},
        "grads": {k: p.grad.detach().cpu().clone() for k, p in params.items()},
        "numel": sum(p.numel() for p in params.values()),
        "calls": record.calls, "payload": record.payload_bytes, "wire": record.wire_bytes,
        "units": len(trainer.pipeline.copy_sum.units),
    }
    trainer.ledger.reset()
    return observed


@pytest.fixture(scope="module")
def references(dist, small_data_dir, tmp_path_factory):
    return reference_runs(dist, small_data_dir, str(tmp_path_factory.mktemp("weights-ref")),
                          COPY_BASE, STEPS)


@pytest.fixture(scope="module")
def tied_references(dist, small_data_dir, tmp_path_factory):
    return reference_runs(dist, small_data_dir, str(tmp_path_factory.mktemp("weights-tied")),
                          TIED_BASE, STEPS)


# CI: p = 2 at m = p, p = 4 at m = 2p + 1 (uneven), dp with an odd share
@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=["p2-m2", "p2-dp2-m3"]))
def test_the_copies_stay_identical_and_the_sum_is_counted(dist, small_data_dir, references,
                                                          tmp_path, layout):
    check_copies(dist, small_data_dir, references, tmp_path, COPY_BASE, layout)


@pytest.mark.parametrize("layout", matrix(list(BITPIPE_LAYOUTS), ci=["bitpipe-p2-m4"]))
def test_bitpipe_order_trains_like_one_process(dist, small_data_dir, references, tmp_path,
                                               layout):
    """BitPipe's own order on the same two copies (loom.schedule.families.bitpipe: its phases,
    units of p microbatches, full backwards): one process's loss, norm and gradients, and the
    copies bit-identical after every step."""
    check_copies(dist, small_data_dir, references, tmp_path, COPY_BASE, layout, "bitpipe")


@pytest.mark.parametrize("layout", matrix(TIED_LAYOUTS, ci=["p2-dp2-m4"]))
def test_tied_embeddings_share_one_weight_per_copy(dist, small_data_dir, tied_references,
                                                   tmp_path, layout):
    """Each copy's embedding and head sit on one rank (copy 0's on rank 0, copy 1's on rank
    p-1) and are one Parameter there; the copy sum adds the two copies' shared weight."""
    check_copies(dist, small_data_dir, tied_references, tmp_path, TIED_BASE, layout)


def check_copies(dist, data_dir, references, tmp_path, base: dict, layout: str,
                 schedule: str = "bidirectional_v") -> None:
    import torch

    world, micro, parallel = {**LAYOUTS, **BITPIPE_LAYOUTS}[layout]
    dp = parallel.get("dp_replicate", 1)
    config = layout_config({**base, "train.global_batch_size": micro * dp,
                            "parallel.schedule": schedule}, world, **parallel)
    results = dist.run(world, record_pipeline, config, data_dir, STEPS, str(tmp_path), copies)
    label = f"{schedule} {layout}{' tied' if base is TIED_BASE else ''}"
    check(references(micro * dp), results, label)
    for step in range(STEPS):
        holders: dict[str, list[int]] = {}
        for rank, result in enumerate(results):
            seen = result["observed"][step]
            # Every gradient element this rank holds, fp32, over a pair: one all-reduce per
            # unit (a model stage, or a tied model's two ends), the bytes of one flat sum.
            assert (seen["calls"], seen["payload"]) == (seen["units"], 4 * seen["numel"]), \
                (label, rank)
            assert seen["wire"] == seen["payload"], (label, rank)
            for name in seen["weights"]:
                holders.setdefault(name, []).append(rank)
        for name, ranks in holders.items():
            # every parameter is held by exactly the two copies in each data-parallel replica
            assert len(ranks) == 2 * dp, (label, name, ranks)
            first = results[ranks[0]]["observed"][step]
            for rank in ranks[1:]:
                other = results[rank]["observed"][step]
                for kind in ("weights", "grads"):
                    assert torch.equal(other[kind][name], first[kind][name]), \
                        f"{label} step {step + 1}: {kind} of {name} on ranks {ranks[0]}, {rank}"


def record_sync(ctx, config_table: dict, data_dir: str, steps: int, eager: bool) -> dict:
    """Per step: loss, grad norm, this rank's gradients and weights (exact CPU copies), the copy
    sum's counted bytes and how many of its units started during the schedule."""
    import torch

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    trainer.pipeline.copy_sum.eager = eager
    record: dict = {"loss": [], "grad_norm": [], "grads": [], "weights": [], "bytes": [],
                    "early": []}
    for _ in range(steps):
        metrics = trainer.train_step()
        params = dict(trainer.model.named_parameters())
        record["loss"].append(metrics["loss"])
        record["grad_norm"].append(metrics["grad_norm"])
        record["grads"].append({k: p.grad.detach().cpu().clone() for k, p in params.items()})
        record["weights"].append({k: p.detach().cpu().clone() for k, p in params.items()})
        record["bytes"].append(trainer.ledger.get("pp_copies", "all_reduce").payload_bytes)
        record["early"].append(trainer.pipeline.copy_sum.launched_early)
        trainer.ledger.reset()
    return record


@pytest.mark.parametrize("layout", matrix(["p2-m5", "p4-m9"], ci=["p4-m9"]))
def test_eager_synchronisation_is_bit_identical_to_the_end_of_step_sum(dist, small_data_dir,
                                                                       layout):
    """Each unit's all-reduce starts as soon as both ranks are past its last W or B; every
    element is still the sum of the same two values, so nothing changes but the timing."""
    import torch

    world, micro, parallel = LAYOUTS[layout]
    config = layout_config({**COPY_BASE, "train.global_batch_size": micro,
                            "parallel.schedule": "bidirectional_v"}, world, **parallel)
    eager, at_end = (dist.run(world, record_sync, config, small_data_dir, STEPS, flag)
                     for flag in (True, False))
    for rank, (fast, slow) in enumerate(zip(eager, at_end)):
        assert fast["loss"] == slow["loss"] and fast["grad_norm"] == slow["grad_norm"], rank
        assert fast["bytes"] == slow["bytes"], rank  # the same bytes, in more calls
        assert all(early >= 1 for early in fast["early"]), (rank, fast["early"])
        assert slow["early"] == [0] * STEPS
        for step in range(STEPS):
            for kind in ("grads", "weights"):
                for name, value in fast[kind][step].items():
                    assert torch.equal(value, slow[kind][step][name]), \
                        f"{layout} rank {rank} step {step + 1}: {kind} of {name}"


RESUME_LAYOUTS = {  # name -> (world size, parallel settings); 8 samples, 2 per microbatch
    "single": (1, {}),
    "bidi-p2": (2, {"pp": 2, "schedule": "bidirectional_v"}),
    "bidi-p2-dp2": (4, {"pp": 2, "dp_replicate": 2, "schedule": "bidirectional_v"}),
}


def resume_config(layout: str) -> tuple[int, dict]:
    world, parallel = RESUME_LAYOUTS[layout]
    return world, layout_config(RESUME_BASE, world, **parallel)


# matrix: without dp (the dp2 case resumes the copies and their replicas)
@pytest.mark.parametrize("layout", matrix(["bidi-p2", "bidi-p2-dp2"], ci=["bidi-p2-dp2"]))
def test_stop_and_resume_is_bit_exact(dist, small_data_dir, tmp_path, layout):
    world, config = resume_config(layout)
    check_resume(dist, small_data_dir, tmp_path, world, config, layout)


@pytest.mark.parametrize("source, target", [("bidi-p2", "single"), ("single", "bidi-p2-dp2")])
def test_a_checkpoint_holds_one_model(dist, small_data_dir, tmp_path, source, target):
    check_reshard(dist, small_data_dir, tmp_path, resume_config(source), resume_config(target),
                  f"{source} -> {target}")


@pytest.mark.matrix  # a CLI run (12 s); the composed layouts above train it in process, and
# test_pipeline_parity.py's ZB-V CLI run covers the command's pipeline path
def test_loom_train_runs_a_bidirectional_pipeline(tmp_path):
    result = loom("train", "--nproc", "2", "--parallel.pp=2",
                  "--parallel.schedule=bidirectional_v", "--model.preset=debug",
                  "--train.steps=2", "--train.global_batch_size=4", "--train.micro_batch_size=1",
                  "--data.seq_len=32", "--data.max_bytes=100000", "--train.eval_every=2",
                  "--optim.warmup_steps=1", "--metrics.tensorboard=false",
                  "--metrics.plot=false", "--train.run_dir=runs/bidi", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "runs" / "bidi" / "model.safetensors").exists()


# -- compositions: tensor, context and expert parallelism, MoE ----------------------------------
COMPOSED = {  # name -> (world, microbatches per pipeline, parallel settings, overrides)
    "p2-tp2": (4, 4, {"pp": 2, "tp": 2}, {}),
    "p2-tp2-vocab-tied": (4, 4, {"pp": 2, "tp": 2},
                          {"parallel.vocab_parallel": True, "model.tie_embeddings": True}),
    "p2-cp2": (4, 4, {"pp": 2, "cp": 2}, {}),
    # the post-validated optimizer step leaves the copy-1 replicas out of its norm too
    "p2-post-validation": (2, 4, {"pp": 2}, {"train.post_validation": True}),
    # ZeRO-3 inside the stages (gathered across the step: the backward is split into I and W)
    "p2-zero3": (4, 4, {"pp": 2, "dp_shard": 2, "zero_stage": 3, "reshard_after_forward": False},
                 {}),
    "p2-hsdp-2x2": (8, 4, {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "zero_stage": 3,
                           "reshard_after_forward": False}, {}),
}
# ZeRO-1/2 inside the stages: the copy sum adds the reduced flat slices (mirror ranks share their
# dp coordinate, so the slices line up) and the norm leaves the copy-1 replicas' slices out
ZERO = {**{f"p2-zero{stage}": (4, 4, {"pp": 2, "dp_shard": 2, "zero_stage": stage},
                               {"metrics.comm": True}) for stage in (1, 2)},
        # HSDP: each slice is averaged over dp_replicate too, before the copy sum
        "p2-hsdp-2x2-zero2": (8, 4, {"pp": 2, "dp_replicate": 2, "dp_shard": 2,
                                     "zero_stage": 2}, {"metrics.comm": True})}
COMPOSED.update(ZERO)
# ... and under tp: the buckets hold each rank's tp shards, mirror ranks share the tp coordinate
COMPOSED["p2-tp2-zero1"] = (8, 4, {"pp": 2, "tp": 2, "dp_shard": 2, "zero_stage": 1}, {})


# CI: tp through the tied vocab-parallel case, ZeRO-3 without tp (matrix: the rest: HSDP,
# ZeRO-1 and ZeRO-2 (flat slices: test_zero_pipeline.py runs them under 1F1B, ZB-V and
# interleaving), cp (routes' cp rings), post-validation's norm)
@pytest.mark.parametrize("layout", matrix(COMPOSED, ci=[name for name in COMPOSED
                                                        if name not in ("p2-tp2", "p2-hsdp-2x2",
                                                                        "p2-zero1",
                                                                        "p2-tp2-zero1",
                                                                        "p2-hsdp-2x2-zero2",
                                                                        "p2-zero2", "p2-cp2",
                                                                        "p2-post-validation")]))
def test_composed_layouts_match_one_process(dist, small_data_dir, tmp_path, layout):
    world, micro, parallel, extra = COMPOSED[layout]
    base = {**BASE, **extra}
    batch = micro * parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    (tmp_path / "ref").mkdir()
    reference = reference_runs(dist, small_data_dir, str(tmp_path / "ref"), base, STEPS)(batch)
    config = layout_config({**base, "train.global_batch_size": batch,
                            "parallel.schedule": "bidirectional_v"}, world, **parallel)
    observe = zero_copies if layout in ZERO else None
    results = dist.run(world, record_pipeline, config, small_data_dir, STEPS, str(tmp_path),
                       observe)
    check(reference, results, f"bidirectional_v {layout}")
    if layout in ZERO:
        check_zero_copies(results, layout, holders=world)  # 2 copies x world / pp replicas


def zero_copies(trainer) -> dict:
    """After a ZeRO-1/2 step: this rank's weights by name, its reduced gradient slices' element
    count (the buckets' padded slices) and the copy sum's counted payload (then reset)."""
    record = trainer.ledger.get("pp_copies", "all_reduce")
    observed = {
        "weights": {k: p.detach().cpu().clone() for k, p in trainer.model.named_parameters()},
        "slices": sum(b.shard.numel() for b in trainer.zero.buckets),
        "payload": record.payload_bytes,
    }
    trainer.ledger.reset()
    return observed


def check_zero_copies(results: list[dict], layout: str, holders: int) -> None:
    """The copy sum moves the reduced slices only (4 bytes per slice element, not the full
    gradients), and the two copies of every parameter stay bit-identical."""
    import torch

    for step in range(STEPS):
        held: dict[str, list[int]] = {}
        for rank, result in enumerate(results):
            seen = result["observed"][step]
            assert seen["payload"] == 4 * seen["slices"], (layout, step, rank)
            for name in seen["weights"]:
                held.setdefault(name, []).append(rank)
        for name, ranks in held.items():
            assert len(ranks) == holders, (layout, name, ranks)
            first = results[ranks[0]]["observed"][step]["weights"][name]
            for rank in ranks[1:]:
                assert torch.equal(results[rank]["observed"][step]["weights"][name], first), \
                    f"{layout} step {step + 1}: {name} on ranks {ranks[0]}, {rank}"


MOE = {  # name -> (world, degrees, routing overrides)
    "p2": (2, {"pp": 2, "dp_replicate": 1}, {}),
    "p2-ep2": (4, {"pp": 2, "ep": 2, "dp_replicate": 1}, {}),
    "p2-ep2-capacity": (4, {"pp": 2, "ep": 2, "dp_replicate": 1}, {"model.capacity_factor": 1.0}),
}


@pytest.mark.parametrize("layout", matrix(MOE, ci=["p2-ep2", "p2-ep2-capacity"]))
def test_moe_matches_one_process(dist, small_data_dir, layout):
    """test_expert_pipeline.py's MoE parity (tiny-moe, 4 microbatches of 2, dropless and with
    capacity drops, its tolerances) with this schedule: each MoE layer's balancing-loss gradient, scaled by the
    trainer, is added on both copies and summed with the rest."""
    from loom.testing.parity import record_training
    from tests.dist.test_expert_tp import BASE as MOE_BASE
    from tests.dist.test_expert_tp import STEPS as MOE_STEPS
    from tests.dist.test_expert_tp import assert_layout_matches

    world, degrees, routing = MOE[layout]
    reference = dist.run(1, record_training, layout_config({**MOE_BASE, **routing}, 1),
                         small_data_dir, MOE_STEPS)[0]
    assert_layout_matches(dist, small_data_dir, reference, world, degrees,
                          {**routing, "parallel.schedule": "bidirectional_v"},
                          f"bidirectional_v MoE {layout}")
