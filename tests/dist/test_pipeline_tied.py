"""Tied embeddings across pipeline stages equal one process, and both copies stay identical.

The first stage holds the embedding, the last stage the output head, whose weight starts as the
embedding's seeded value; after every step's backward the two gradients are summed over the
2-rank group {first stage's rank, last stage's rank} (``loom.pipeline.runtime.tie_embedding``).
A V placement (ZB-V) holds both ends on one rank: one shared Parameter.

Parity (fp32, the debug model with ``tie_embeddings``, 4 steps, 4 microbatches per pipeline):
loss, gradient norm and every parameter's gradient against one process; the validation loss and
the saved weights too (``test_pipeline_parity.check``). Layouts: pp2 1F1B, pp2 interleaved 1F1B
(2 chunks per rank), pp2 ZB-V (same rank), ZB-V x dp2 (the shared weight reduced once by the
first stage's reducer), pp2 x dp2, pp2 x tp2 with vocab_parallel (each tp rank ties its own vocab
shard; with and without sequence parallelism), pp2 x dp_shard2 (ZeRO-3: each copy sharded, the
local shards summed), pp2 x dp_shard2 with ZeRO-1 and ZeRO-2 (each copy bucketed alone, the
reduced slices summed; 1F1B and interleaved), pp2 x cp2 (1F1B, ZB-V: one tie pair per cp
coordinate), an MoE model (pp2, pp2 x ep2), and pp2 1F1B with the post-validated optimizer
step. After every step the embedding on the first stage and the head on the last stage must be
bit-identical, weights and gradients (``torch.equal``; under ZeRO-1/2 the reduced slices,
gathered), on every rank that holds one. The tie all-reduce is counted: 4·V·D/t bytes per tie
rank per step.

Tolerances are test_pipeline_parity.py's: step 1 differs from one process only by summation order
(the tied gradient is summed as embedding part + head part here, interleaved by microbatch there):
rtol 1e-5, atol 1e-6; later steps inherit Adam's amplification of rounding-level elements: rtol
1e-4, atol 1e-5.
"""

from __future__ import annotations


import pytest

from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_pipeline_parity import check, record_pipeline, reference_runs

STEPS = 4
MICRO = 4  # microbatches per pipeline
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.tie_embeddings": True,
        "train.steps": STEPS, "train.micro_batch_size": 1, "train.eval_batches": 2,
        "optim.warmup_steps": 2, "optim.lr": 1e-3, "train.grad_clip": 1.0}
LAYOUTS = {  # name -> (world size, parallel settings)
    "1f1b": (2, {"pp": 2, "schedule": "1f1b"}),
    "interleaved-2-chunks": (2, {"pp": 2, "schedule": "interleaved_1f1b", "chunks": 2}),
    "zbv": (2, {"pp": 2, "schedule": "zbv"}),
    "zbv-dp2": (4, {"pp": 2, "dp_replicate": 2, "schedule": "zbv"}),
    "1f1b-dp2": (4, {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}),
    "1f1b-tp2-vocab": (4, {"pp": 2, "tp": 2, "vocab_parallel": True, "schedule": "1f1b"}),
    "1f1b-tp2-vocab-sp": (4, {"pp": 2, "tp": 2, "vocab_parallel": True,
                              "sequence_parallel": True, "schedule": "1f1b"}),
    "1f1b-zero3": (4, {"pp": 2, "dp_shard": 2, "schedule": "1f1b",
                       "reshard_after_forward": False}),
    # ZeRO-1/2: each copy bucketed alone, its reduced slices summed over the pair
    "1f1b-zero1": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1, "schedule": "1f1b"}),
    "1f1b-zero2": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 2, "schedule": "1f1b"}),
    "interleaved-zero1": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1,
                              "schedule": "interleaved_1f1b", "chunks": 2}),
    # the pair's tie sum per cp coordinate, after the gradients' mean over dp x cp
    "1f1b-cp2": (4, {"pp": 2, "cp": 2, "schedule": "1f1b"}),
    "zbv-cp2": (4, {"pp": 2, "cp": 2, "schedule": "zbv"}),
    # an MoE model: experts and router per stage, the tied ends as in a dense one
    "1f1b-moe": (2, {"pp": 2, "schedule": "1f1b"}, {"model.preset": "tiny-moe"}),
    "1f1b-moe-ep2": (4, {"pp": 2, "ep": 2, "schedule": "1f1b"}, {"model.preset": "tiny-moe"}),
    # The post-validated optimizer step leaves the replica out of its norm too.
    "1f1b-post-validation": (2, {"pp": 2, "schedule": "1f1b"}, {"train.post_validation": True}),
}


def tied_copy(trainer) -> dict:
    """After a step: this rank's copy of the tied weight and its gradient (full tensors; None on
    a rank with neither end), and the tie all-reduce's counted wire bytes (then reset)."""
    from loom.parallel.zero import ZeroShardedOptimizer

    weight = trainer.pipeline.tied_weight
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    grad = None if weight is None else weight.grad
    end = 0 if 0 in trainer.pipeline.stages else trainer.pipeline.schedule.num_stages - 1
    reducer = trainer.pipeline.reducers.get(end)
    if weight is not None and isinstance(reducer, ZeroShardedOptimizer):
        # ZeRO-1/2: the reduced slices the optimizer steps, gathered over dp_shard (collective;
        # a tied head's bucket carries the embedding's global name)
        grad = reducer.full_named_gradients()["tok_embeddings.weight"]
    copy = None if weight is None else (full(weight), full(grad))
    stages, final = trainer.pipeline.stages, trainer.pipeline.schedule.num_stages - 1
    shared = 0 in stages and final in stages and \
        stages[final].module.output.weight is stages[0].module.tok_embeddings.weight
    wire = trainer.ledger.get("pp_tie", "all_reduce").wire_bytes if trainer.ledger else None
    if trainer.ledger:
        trainer.ledger.reset()
    return {"copy": copy, "shared": shared, "tie_wire_bytes": wire}


@pytest.fixture(scope="module")
def references(dist, small_data_dir, tmp_path_factory):
    """One process by (global batch, model preset; None: BASE's), computed on first use."""
    runs: dict = {}

    def get(global_batch: int, preset: str | None = None) -> dict:
        if preset not in runs:
            base = {**BASE, **({"model.preset": preset} if preset else {})}
            runs[preset] = reference_runs(dist, small_data_dir,
                                          str(tmp_path_factory.mktemp("weights-ref")), base, STEPS)
        return runs[preset](global_batch)
    return get


# (a tied vocabulary-parallel head under tp across stages runs in CI in
# test_pipeline_bidirectional.py's p2-tp2-vocab-tied; both variants here in the matrix)
MATRIX_ONLY = {"zbv-cp2", "1f1b-moe"}  # (cp and MoE run in CI under 1F1B with cp2, ep2)


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[
    name for name in LAYOUTS if not name.startswith("1f1b-tp2-vocab") and name not in MATRIX_ONLY]))
def test_tied_pipeline_matches_one_process(dist, small_data_dir, references, tmp_path, layout):
    import torch

    world, parallel, *train = LAYOUTS[layout]
    dp = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    config = layout_config({**BASE, "train.global_batch_size": MICRO * dp, "metrics.comm": True,
                            **(train[0] if train else {})}, world, **parallel)
    results = dist.run(world, record_pipeline, config, small_data_dir, STEPS, str(tmp_path),
                       tied_copy)
    check(references(MICRO * dp, (train[0] if train else {}).get("model.preset")), results,
          f"tied {layout}")
    holders = [r for r in results if r["observed"][0]["copy"] is not None]
    v_shaped = parallel["schedule"] == "zbv"  # both ends on pp rank 0: one shared Parameter
    assert len(holders) == (world // 2 if v_shaped else world), layout
    assert all(r["observed"][0]["shared"] == v_shaped for r in holders), layout
    for step in range(STEPS):
        weight, grad = holders[0]["observed"][step]["copy"]
        for rank, result in enumerate(holders):
            other_weight, other_grad = result["observed"][step]["copy"]
            assert torch.equal(other_weight, weight), f"{layout} step {step + 1} rank {rank}"
            assert torch.equal(other_grad, grad), f"{layout} step {step + 1} rank {rank} grad"


def test_the_tie_all_reduce_is_counted(dist, small_data_dir, tmp_path):
    """pp2 x tp2 (vocab_parallel), steps 1 and 2: each tie rank all-reduces its
    vocab shard of the gradient once per step over 2 ranks: 2 (2-1)/2 x 4 V D / t bytes."""
    from loom.models import preset

    world, parallel = LAYOUTS["1f1b-tp2-vocab"]
    config = layout_config({**BASE, "train.global_batch_size": MICRO, "metrics.comm": True},
                           world, **parallel)
    results = dist.run(world, record_pipeline, config, small_data_dir, 2, str(tmp_path),
                       tied_copy)
    args = preset("debug")
    expected = 2 * (2 - 1) / 2 * 4 * args.vocab_size * args.dim / 2
    for rank, result in enumerate(results):
        for step, observed in enumerate(result["observed"]):
            assert observed["tie_wire_bytes"] == expected, (rank, step, observed, expected)
