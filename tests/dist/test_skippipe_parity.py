"""SkipPipe's runtime (issue 18, ``loom.pipeline.paths_runtime``) against one process, fp32.

* Skip 0 with one replica is the ordinary pipeline: pp = 4 ranks run the full paths and give the
  same loss and every gradient as Loom's pipeline interpreter running GPipe on the same stages,
  and as one process running the whole model.
* Skipping and swapping: pp = 4 with skip ratio 0.25 and one swap allowed (every path visits
  three stages, some in swapped order); and pp = 2 x 2 replicas (4 ranks) with random replicas.
  Before the replicas' reduction each rank's gradient equals the sum, over exactly the
  microbatches whose paths visited that replica, of the gradient of one process running that
  microbatch's path (the model applying only the path's layers, in the path's order); after it,
  every replica holds its stage's sum over the whole batch. The loss is the batch's, and a
  forward-only run of the skipping paths (evaluation, or inference through part of the model)
  gives the same loss and leaves no gradient.
* The data-parallel convention the trainer will use: each replica loads only its share of the
  microbatches, scales its losses by that share, gathers the batch over the stage group
  (``gather_microbatches``), and the replicas average: the batch's loss and gradient.

Tolerances: rtol 1e-5 / atol 1e-6 (tests/dist/test_pipeline_parity.py's step-1 tolerance: the
same operations, only the order of the gradient accumulation differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from loom.cluster import Link, regions

from loom.models import PRESETS, build_model, reset_parameters
from loom.pipeline.partition import partition_model
from loom.pipeline.paths_runtime import (PathRuntime, build_path_stage, gather_microbatches,
                                        path_groups)
from loom.pipeline.runtime import PipelineRuntime
from loom.pipeline.stage import build_stages
from loom.schedule.families import get
from loom.schedule.path_replay import PathCosts, execution_orders, replay_paths
from loom.schedule.path_search import schedule_paths
from loom.schedule.paths import PathSet, check_paths, full_paths, random_paths, skip_count
from loom.testing.parity import layout_config
from tests.dist.test_pipeline_parity import BASE, STEPS, check, record_pipeline, reference_runs

SEED, MICRO, SEQ = 7, 2, 16
ARGS = PRESETS["debug"]  # 4 layers: one per stage at pp = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _batch(num_microbatches: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, ARGS.vocab_size, (num_microbatches, MICRO, SEQ + 1),
                           generator=generator)
    return [t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens]


def _loss_fn(num_microbatches: int):
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / num_microbatches
    return loss


def _path_reference(paths: PathSet) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """One process: the batch loss and, per microbatch, every parameter's gradient when the
    whole model applies only that microbatch's path's layers, in the path's order."""
    model = build_model(ARGS, device="meta")
    model.to_empty(device="cpu")
    reset_parameters(model, SEED)
    layers = partition_model(ARGS, paths.num_stages, SEQ)
    inputs, targets = _batch(paths.num_microbatches)
    loss_fn = _loss_fn(paths.num_microbatches)
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    total, grads = 0.0, []
    for m, path in enumerate(paths.paths):
        model.zero_grad(set_to_none=True)
        h = model.tok_embeddings(inputs[m])
        for stage in path.stages:
            for layer in layers[stage]:
                h = model.layers[str(layer)](h, cos, sin)
        loss = loss_fn(model.output(model.norm(h)), targets[m])
        loss.backward()
        total += loss.item()
        grads.append({name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                      for name, p in model.named_parameters()})
    return total, grads


def _run_paths(ctx, paths_json: str, orders=None, training: bool = True) -> dict:
    """On each rank: one step of the paths (each replica's order ``orders``, default a uniform
    replay's); the loss, and this replica's gradients before and after the replicas'
    reduction, by global name."""
    paths = PathSet.from_json(paths_json)
    stages, replicas = paths.num_stages, paths.num_replicas
    stage, replica = divmod(ctx.rank, replicas)
    ranks = list(range(stages * replicas))
    layers = partition_model(ARGS, stages, SEQ)
    pipeline_stage = build_path_stage(ARGS, stages, stage, layers, "cpu", SEED)
    runtime = PathRuntime(paths, pipeline_stage, replica, ranks,
                          stage_group=path_groups(stages, replicas, ranks, ctx.rank),
                          orders=orders)
    inputs, targets = _batch(paths.num_microbatches)
    loss = runtime.step(inputs, targets, _loss_fn(paths.num_microbatches),
                        activation_shape=(MICRO, SEQ, ARGS.dim), training=training)
    if not training:  # forward only (evaluation, or inference through part of the model)
        assert all(p.grad is None for p in pipeline_stage.module.parameters())
        return {"loss": loss.item()}
    named = dict(pipeline_stage.module.named_parameters())
    before = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
              for k, p in named.items()}
    runtime.finish_gradient_reduction()
    after = {k: p.grad.clone() for k, p in named.items()}
    return {"loss": loss.item(), "stage": stage, "replica": replica, "before": before,
            "after": after}


def _run_gpipe(ctx, num_microbatches: int) -> dict:
    """Loom's ordinary pipeline interpreter, GPipe at pp = world size, same stages."""
    schedule = get("gpipe")(ctx.world_size, num_microbatches)
    layers = partition_model(ARGS, ctx.world_size, SEQ)
    stages = build_stages(ARGS, schedule, layers, ctx.rank, "cpu", SEED)
    runtime = PipelineRuntime(schedule, stages, ctx.rank, list(range(ctx.world_size)),
                              dist.group.WORLD)
    inputs, targets = _batch(num_microbatches)
    loss = runtime.step(inputs, targets, _loss_fn(num_microbatches),
                        activation_shape=(MICRO, SEQ, ARGS.dim))
    (stage,) = stages.values()
    return {"loss": loss.item(),
            "grads": {k: p.grad.clone() for k, p in stage.module.named_parameters()}}


def _check_against_reference(results: list[dict], paths: PathSet) -> None:
    total, per_microbatch = _path_reference(paths)
    for result in results:
        assert abs(result["loss"] - total) <= 1e-5 * abs(total)
        stage, replica = result["stage"], result["replica"]
        visitors = paths.visitors(stage, replica)
        every = [m for m in range(paths.num_microbatches) if stage in paths.paths[m].stages]
        for name, grad in result["before"].items():
            expected = sum((per_microbatch[m][name] for m in visitors),
                           torch.zeros_like(grad))
            torch.testing.assert_close(grad, expected, **TOL, msg=lambda s: f"{name}: {s}")
            expected_all = sum((per_microbatch[m][name] for m in every), torch.zeros_like(grad))
            torch.testing.assert_close(result["after"][name], expected_all, **TOL)


def test_skip_zero_one_replica_is_the_ordinary_pipeline(dist):
    m = 4
    paths = full_paths(4, m)
    check_paths(paths, skip_count(4, 0.0))
    results = dist.run(4, _run_paths, paths.to_json())
    ordinary = dist.run(4, _run_gpipe, m)
    for mine, theirs in zip(results, ordinary):
        assert mine["loss"] == theirs["loss"]
        for name, grad in mine["before"].items():  # the same operations in the same order
            assert torch.equal(grad, theirs["grads"][name]), name
    # ... and one process running the whole model (every microbatch's full path)
    model = build_model(ARGS, device="meta")
    model.to_empty(device="cpu")
    reset_parameters(model, SEED)
    inputs, targets = _batch(m)
    loss = sum(_loss_fn(m)(model(x), y) for x, y in zip(inputs, targets))
    loss.backward()
    reference = dict(model.named_parameters())
    assert abs(results[0]["loss"] - loss.item()) <= 1e-5 * abs(loss.item())
    for result in results:
        for name, grad in result["before"].items():
            torch.testing.assert_close(grad, reference[name].grad, **TOL)


def test_each_replica_gets_exactly_its_visitors_gradients(dist):
    # pp = 4, one replica: skip 1 of 4 stages, one swap allowed (stages 1 and 2 change order
    # where both are visited: with a skip no path has both, so swaps come from the skip-0 set)
    skipping = random_paths(skip_count(4, 0.25), 1, 6, seed=1)
    swapping = random_paths(skip_count(4, 0.0, max_swaps=1), 1, 4, seed=3,
                            swap_probability=0.5)
    assert {p.stages for p in swapping.paths} == {(0, 1, 2, 3), (0, 2, 1, 3)}
    assert {p.stages for p in skipping.paths} == {(0, 1, 3), (0, 2, 3)}
    # pp = 2 x 2 replicas: every microbatch visits both stages, on random replicas
    replicated = random_paths(skip_count(2, 0.0), 2, 5, seed=3)
    assert any(p.replicas[0] != p.replicas[1] for p in replicated.paths)
    for paths in (skipping, swapping, replicated):
        _check_against_reference(dist.run(4, _run_paths, paths.to_json()), paths)
    # forward only through the skipping paths (inference with part of the model): the same loss
    total, _ = _path_reference(skipping)
    for result in dist.run(4, _run_paths, skipping.to_json(), None, False):
        assert abs(result["loss"] - total) <= 1e-5 * abs(total)


def _run_shares(ctx, paths_json: str) -> dict:
    """The trainer's convention: each replica loads its own share of the microbatches (as a
    data-parallel rank: replica r holds microbatches j * R + r of the batch), scales each loss
    by its share (1 / (M / R)), gathers the batch over the stage group, and the replicas
    average. Returns the loss and the averaged gradients."""
    paths = PathSet.from_json(paths_json)
    stages, replicas = paths.num_stages, paths.num_replicas
    stage, replica = divmod(ctx.rank, replicas)
    ranks = list(range(stages * replicas))
    group = path_groups(stages, replicas, ranks, ctx.rank)
    pipeline_stage = build_path_stage(ARGS, stages, stage, partition_model(ARGS, stages, SEQ),
                                      "cpu", SEED)
    runtime = PathRuntime(paths, pipeline_stage, replica, ranks, stage_group=group)
    inputs, targets = _batch(paths.num_microbatches)
    share = range(replica, paths.num_microbatches, replicas)
    mine_in = gather_microbatches([inputs[m] for m in share], group, replicas)
    mine_tg = gather_microbatches([targets[m] for m in share], group, replicas)
    assert all(torch.equal(a, b) for a, b in zip(mine_in, inputs))  # the batch, in order
    assert all(torch.equal(a, b) for a, b in zip(mine_tg, targets))
    loss = runtime.step(mine_in, mine_tg, _loss_fn(len(share)),
                        activation_shape=(MICRO, SEQ, ARGS.dim))
    runtime.finish_gradient_reduction(average=True)
    return {"loss": loss.item() / replicas, "stage": stage, "replica": replica,
            "after": {k: p.grad.clone() for k, p in pipeline_stage.module.named_parameters()}}


def test_replicas_loading_their_own_shares_average_to_the_batch_gradient(dist):
    paths = random_paths(skip_count(2, 0.0), 2, 4, seed=5)
    total, per_microbatch = _path_reference(paths)
    for result in dist.run(4, _run_shares, paths.to_json()):
        assert abs(result["loss"] - total) <= 1e-5 * abs(total)
        for name, grad in result["after"].items():
            expected = sum((g[name] for g in per_microbatch), torch.zeros_like(grad))
            torch.testing.assert_close(grad, expected, **TOL)


GBIT = 1e9 / 8


@pytest.mark.slow
def test_scheduled_paths_with_skips_and_replicas_at_pp4_x_2(dist):
    """8 ranks: 4 stages x 2 replicas, skip 0.25, paths chosen by the path scheduler on a
    two-region cluster and run in that cluster's replay order (not the uniform one): the same
    per-replica sums against one process."""
    cluster = regions([4, 4], intra=Link(1e-3, 10 * GBIT), inter=Link(0.05, 0.1 * GBIT),
                      compute=[1.0, 0.5])
    allocation = {(s, r): (r if s % 2 == 0 else 1 - r) * 4 + s for s in range(4) for r in (0, 1)}
    costs = PathCosts.uniform(4, 0.1, activation_bytes=4e6, gradient_bytes=2e6)
    rules = skip_count(4, 0.25)
    paths = schedule_paths(rules, 2, 6, cluster, allocation, costs)
    check_paths(paths, rules)
    assert {p.stages for p in paths.paths} == {(0, 1, 3), (0, 2, 3)}
    assert len({p.replicas for p in paths.paths}) > 2
    orders = execution_orders(paths, replay_paths(paths, cluster, allocation, costs))
    _check_against_reference(dist.run(8, _run_paths, paths.to_json(), orders), paths)


# -- through the trainer (parallel.schedule = "skippipe") -----------------------------------------

@pytest.fixture(scope="module")
def one_process(dist, small_data_dir, tmp_path_factory):
    return reference_runs(dist, small_data_dir, str(tmp_path_factory.mktemp("skippipe-ref")),
                          BASE, STEPS)


@pytest.mark.parametrize("pp, replicas", [pytest.param(4, 1, marks=pytest.mark.slow), (2, 2)])
def test_loom_train_skippipe_at_skip_zero_matches_one_process(dist, small_data_dir, one_process,
                                                              tmp_path, pp, replicas):
    """``parallel.schedule = skippipe`` with skip 0 through the trainer: the replicas load
    their own shares (dp_replicate = stage_replicas), gather the batch, average their
    gradients; 2 steps of loss, norm and every gradient, and the validation loss, against one
    process (test_pipeline_parity's helpers and tolerances)."""
    config = layout_config({**BASE, "train.global_batch_size": 4, "parallel.schedule": "skippipe",
                            "parallel.stage_replicas": replicas}, 4, pp=pp,
                           dp_replicate=replicas)
    results = dist.run(4, record_pipeline, config, small_data_dir, STEPS, str(tmp_path))
    check(one_process(4), results, f"skippipe pp={pp} x {replicas} replicas")
