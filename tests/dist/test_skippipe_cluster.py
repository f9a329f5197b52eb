"""SkipPipe through the trainer on a described cluster (issue 18 items 4 and 6): the paths come
from the path scheduler run on that cluster, and a resumed run keeps the paths it trained with.

* The trainer's rank context carries the cluster (``DistContext.cluster``, what ``loom train
  --cluster FILE --emulate`` gives every worker). Its training paths are exactly
  ``schedule_paths`` on that cluster, with each stage replica on the node of its rank and the
  trainer's measured costs, and differ from the uniform plan it makes without a cluster (here
  the node of stage 1's replica 1 is 20x slower and behind a slow link, so the scheduler keeps
  most microbatches off it). Training there (with the links' latency added in software to
  every pipeline message) still computes the one-process loss, gradients and validation loss.
* Checkpoint and resume: the paths and each replica's order of work are planned from forward
  times measured at start-up, so planning again on resume could choose others. A run that saves
  at step 2 and goes on to step 4 ends bit for bit where a new trainer that resumes that
  checkpoint ends, although the new one, on its own, plans other paths (its cluster differs):
  it runs the saved paths in the saved orders.
* Latency emulated in software: every pipeline message is held until the link's latency has
  passed since it was sent, without changing what it carries.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom.cluster import Cluster, Link, Node
from loom.config import from_dict
from loom.emulate import cluster_of
from loom.pipeline.paths_runtime import plan_paths
from loom.schedule.path_replay import PathCosts
from loom.schedule.path_search import schedule_paths
from loom.schedule.paths import PathSet, skip_count
from loom.testing.parity import layout_config
from tests.dist.test_checkpoint_resume import _full_state
from tests.dist.test_pipeline_parity import BASE, STEPS, check, record_pipeline, reference_runs

FAST, SLOW = Link(1e-4, 1.25e9), Link(0.02, 12.5e6)  # 10 Gbit/s, 0.1 ms; 100 Mbit/s, 20 ms


def slow_node_cluster(slow: int, size: int = 4) -> Cluster:
    """``size`` nodes on fast links, except node ``slow``: 20x slower, behind slow links."""
    nodes = tuple(Node(f"n{i}", compute=0.05 if i == slow else 1.0) for i in range(size))
    links = {(a, b): SLOW for a in range(size) for b in range(size)
             if a != b and slow in (a, b)}
    return Cluster(nodes, FAST, links)


CONFIG = layout_config({**BASE, "train.global_batch_size": 4, "parallel.schedule": "skippipe",
                        "parallel.stage_replicas": 2}, 4, pp=2, dp_replicate=2)


def _plan(trainer) -> dict:
    plan = trainer.pipeline.plan
    return {"paths": trainer.pipeline.paths.to_json(), "forward_s": list(plan.costs.forward_s),
            "activation_bytes": plan.costs.activation_bytes,
            "gradient_bytes": list(plan.costs.gradient_bytes),
            "allocation": sorted(plan.allocation.items()), "measured": plan.measured,
            "microbatches": plan.num_microbatches}


def _record_on(ctx, cluster_toml: str, config_table: dict, data_dir: str, steps: int,
               weights: str) -> dict:
    return record_pipeline(dataclasses.replace(ctx, cluster=cluster_of(cluster_toml)),
                           config_table, data_dir, steps, weights, observe=_plan)


@pytest.fixture(scope="module")
def one_process(dist, small_data_dir, tmp_path_factory):
    return reference_runs(dist, small_data_dir, str(tmp_path_factory.mktemp("cluster-ref")),
                          BASE, STEPS)


def test_the_trainers_paths_are_the_path_schedulers_for_the_cluster(dist, small_data_dir,
                                                                     one_process, tmp_path):
    cluster = slow_node_cluster(slow=3)  # rank 3: stage 1, replica 1 (pp outer, replicas inner)
    results = dist.run(4, _record_on, cluster.to_toml(), CONFIG, small_data_dir, STEPS,
                       str(tmp_path))
    plans = [r["observed"][0] for r in results]
    assert all(plan == plans[0] for plan in plans)  # one plan, every rank runs it
    plan = plans[0]
    assert plan["measured"] and all(t > 0 for t in plan["forward_s"])
    assert all(b > 0 for b in plan["gradient_bytes"])
    allocation = dict((tuple(k), v) for k, v in plan["allocation"])
    assert allocation == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    rules, microbatches = skip_count(2, 0.0), plan["microbatches"]
    assert microbatches == 4
    costs = PathCosts(tuple(plan["forward_s"]), plan["activation_bytes"],
                      gradient_bytes=tuple(plan["gradient_bytes"]))
    expected = schedule_paths(rules, 2, microbatches, cluster, allocation, costs)
    trained = PathSet.from_json(plan["paths"])
    assert trained == expected
    uniform = plan_paths(rules, 2, microbatches, costs.activation_bytes, costs.gradient_bytes,
                         [0, 1, 2, 3], None).paths
    assert trained != uniform  # the cluster changed the plan ...
    on_slow = sum(p.visits[1].replica == 1 for p in trained.paths)
    assert on_slow < sum(p.visits[1].replica == 1 for p in uniform.paths)  # ... off rank 3
    # the same losses, gradients and validation loss as one process (latency emulated)
    check(one_process(4), results, "skippipe pp=2 x 2 replicas on a slow-node cluster")


def _save_go_on_and_resume(ctx, config_table: dict, data_dir: str, run_dir: str, first: str,
                           second: str, steps: int) -> dict:
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    config = from_dict(config_table)
    straight = Trainer(config, Path(data_dir), Path(run_dir),
                       dataclasses.replace(ctx, cluster=cluster_of(first)))
    for _ in range(steps // 2):
        straight.train_step()
    straight.save_checkpoint()
    straight.wait_for_checkpoint()
    straight_losses = [straight.train_step()["loss"] for _ in range(steps - steps // 2)]
    straight_state = _full_state(straight)
    resumed = Trainer(config, Path(data_dir), Path(run_dir),
                      dataclasses.replace(ctx, cluster=cluster_of(second)))
    own_paths = resumed.pipeline.paths
    resumed.resume("auto", log=lambda message: None)
    assert resumed.step == steps // 2
    resumed_losses = [resumed.train_step()["loss"] for _ in range(steps - steps // 2)]
    resumed_state = _full_state(resumed)
    return {"planned_other_paths": own_paths != straight.pipeline.paths,
            "same_paths": resumed.pipeline.paths == straight.pipeline.paths,
            "same_orders": resumed.pipeline.train.orders == straight.pipeline.train.orders,
            "losses": (straight_losses, resumed_losses),
            "states": (straight_state, resumed_state) if ctx.rank == 0 else None}


def test_resume_runs_the_saved_paths_and_ends_where_the_straight_run_ends(dist, small_data_dir,
                                                                          tmp_path):
    steps = 4
    config = {**CONFIG, "train": {**CONFIG["train"], "steps": steps}}
    results = dist.run(4, _save_go_on_and_resume, config, small_data_dir, str(tmp_path),
                       slow_node_cluster(slow=3).to_toml(), slow_node_cluster(slow=2).to_toml(),
                       steps)
    assert all(r["planned_other_paths"] for r in results)  # resuming plans again: other paths
    assert all(r["same_paths"] and r["same_orders"] for r in results)
    for r in results:
        straight, resumed = r["losses"]
        assert straight == resumed
    straight, resumed = results[0]["states"]
    assert straight.keys() == resumed.keys()
    for name in straight:
        a, b = straight[name], resumed[name]
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name


def _one_step_time(ctx, cluster_toml: str | None) -> dict:
    """pp = 2, one replica, 2 microbatches of the debug model: the step's wall time and loss,
    with the cluster's latency emulated (``emulated_link_time``) or not."""
    import time

    from loom.models import PRESETS
    from loom.pipeline.partition import partition_model
    from loom.pipeline.paths_runtime import PathRuntime, build_path_stage, emulated_link_time
    from loom.schedule.paths import full_paths

    args, micro, seq = PRESETS["debug"], 2, 16
    stage = build_path_stage(args, 2, ctx.rank, partition_model(args, 2, seq), "cpu", 7)
    link_time = emulated_link_time(cluster_of(cluster_toml)) if cluster_toml else None
    runtime = PathRuntime(full_paths(2, 2), stage, 0, [0, 1], link_time=link_time)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, micro, seq + 1), generator=g)
    loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), y.flatten()) / 2
    start = time.perf_counter()
    loss = runtime.step([t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens], loss_fn,
                        activation_shape=(micro, seq, args.dim))
    return {"seconds": time.perf_counter() - start, "loss": loss.item()}


def test_emulated_latency_holds_every_pipeline_message(dist):
    """Each microbatch crosses the 0.25 s link forward and back: at least 2 x 0.25 s on the
    critical path with the latency emulated, the same loss, and well under that without."""
    far = Cluster((Node("a"), Node("b")), Link(0.25, 1.25e9))
    slow = dist.run(2, _one_step_time, far.to_toml())
    plain = dist.run(2, _one_step_time, None)
    assert slow[0]["loss"] == plain[0]["loss"]
    assert min(r["seconds"] for r in slow) >= 0.5
    assert max(r["seconds"] for r in plain) < 0.5
