"""Pipeline parallelism is one process, split: every schedule family gives the same numbers.

For every registered family, and the schedule search's pick (``parallel.schedule = "search"``),
p in {2, 4} and m in {p, 2p+1} microbatches per pipeline, two
optimizer steps on the pipeline give the same loss, gradient norm and every parameter's gradient
as one process with the same global batch (fp32, debug preset with 8 layers so that p = 4 with
two stages per rank still has a layer per stage). Then the validation loss (forward-only through
the stages) and the saved weights (gathered to rank 0) must match too. The same for every family
combined with data parallelism (pp = 2 x dp = 2). Families that cannot schedule a combination
(DualPipeV needs m >= 2p) are skipped with the family's own rule as the reason.

Last, the command line: ``loom train --nproc 2 --parallel.pp=2 --parallel.schedule=zbv`` runs,
and a schedule the config cannot run exits 2 before any process starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom.schedule.select import schedule_for
from loom.schedule.families import names
from loom.testing.parity import assert_parity, layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

STEPS = 2
BASE = {
    **SMALL_DATA_OVERRIDES,
    "model.preset": "debug",
    "model.n_layers": 8,
    "train.steps": STEPS,
    "train.micro_batch_size": 1,
    "train.eval_batches": 2,
    "optim.warmup_steps": 2,
    "optim.lr": 1e-3,
    "train.grad_clip": 1.0,
}
# Same reasoning as tests/dist/test_data_parallel.py. Step 1 starts from identical weights and
# the microbatches are the same sizes as the reference's, so the pipeline differs only in the
# order in which microbatch gradients accumulate (each schedule has its own W order) and in the
# pp-summed clipping norm: rounding level, measured 0 to ~2e-7 of the largest gradient.
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
# Later steps: Adam amplifies rounding-level gradient differences of elements whose gradient is
# itself near zero (each element is divided by its own RMS), and the next gradients inherit it.
RTOL, ATOL = 1e-4, 1e-5


def record_pipeline(ctx, config_table: dict, data_dir: str, steps: int, weights_path: str,
                    observe=None) -> dict:
    """Per step: loss, grad norm and named gradients (and ``observe(trainer)``'s result under
    "observed", when given); then the validation loss and, on rank 0, the saved weights."""
    import torch
    from safetensors.torch import load_file

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    record: dict = {"loss": [], "grad_norm": [], "grads": [], "observed": []}
    for _ in range(steps):
        metrics = trainer.train_step()
        record["loss"].append(metrics["loss"])
        record["grad_norm"].append(metrics["grad_norm"])
        record["grads"].append({k: v.cpu() for k, v in trainer.named_gradients().items()})
        if observe is not None:
            record["observed"].append(observe(trainer))
    record["val_loss"] = trainer.evaluate()
    path = Path(weights_path) / f"{trainer.config.parallel.pp}-{ctx.world_size}.safetensors"
    trainer.save_weights(path)
    record["weights"] = load_file(str(path)) if ctx.rank == 0 else None
    return record


def reference_runs(dist, data_dir: str, out: str, base: dict, steps: int):
    """A function of the global batch size: the one-process run of ``base`` with it
    (``record_pipeline``), computed on first use."""
    cache: dict[int, dict] = {}

    def get(global_batch: int) -> dict:
        if global_batch not in cache:
            config = layout_config({**base, "train.global_batch_size": global_batch}, 1)
            cache[global_batch] = dist.run(1, record_pipeline, config, data_dir, steps, out)[0]
        return cache[global_batch]

    return get


def tied_reference_runs(dist, data_dir: str, out_dirs, base: dict, steps: int):
    """``reference_runs`` by (global batch, tied embeddings): ``base`` with
    ``model.tie_embeddings`` off and on, each in its own directory from ``out_dirs``
    (``tmp_path_factory``), computed on first use."""
    runs = {tied: reference_runs(dist, data_dir, str(out_dirs.mktemp("ref")),
                                 {**base, "model.tie_embeddings": tied}, steps)
            for tied in (False, True)}
    return lambda batch, tied: runs[tied](batch)


@pytest.fixture(scope="module")
def references(dist, small_data_dir, tmp_path_factory):
    """One-process runs by global batch size, computed on first use."""
    return reference_runs(dist, small_data_dir, str(tmp_path_factory.mktemp("weights-ref")), BASE,
                          STEPS)


def check(reference: dict, results: list[dict], label: str) -> None:
    import torch

    for rank, result in enumerate(results):
        where = f"{label} rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=where)
        torch.testing.assert_close(torch.tensor(result["val_loss"]),
                                   torch.tensor(reference["val_loss"]), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{where} validation loss: {m}")
    saved, expected = results[0]["weights"], reference["weights"]
    assert set(saved) == set(expected), f"{label}: saved weights have other names"
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{label} saved {n}: {m}")


def skip_unless_schedulable(family: str, pp: int, microbatches: int) -> None:
    try:
        schedule_for(family, pp, microbatches)
    except ValueError as err:
        pytest.skip(f"not a valid combination: {err}")


# "search": the schedule Loom's search picks (uniform costs, limit pp), placement included
FAMILIES = [*names(), "search"]
CASES = [(family, pp, m) for family in FAMILIES for pp in (2, 4) for m in (pp, 2 * pp + 1)]


# CI runs every family at four stages with m = 2p + 1 (uneven), and with m = p (the warm-up
# exactly fills) the two kinds of backward: 1F1B's full one and ZB-V's split one on a V (the
# runtime executes every family's actions the same way; the other m = p cases run in the
# matrix); two stages run in test_pipeline_with_data_parallel_matches_one_process
M_EQUALS_P = ("1f1b", "zbv")


@pytest.mark.parametrize("family, pp, microbatches",
                         matrix(CASES, ci=[(f, p, m) for f, p, m in CASES
                                           if p == 4 and (m == 2 * p + 1 or f in M_EQUALS_P)]),
                         ids=[f"{f}-p{p}-m{m}" for f, p, m in CASES])
def test_pipeline_matches_one_process(dist, small_data_dir, references, tmp_path, family, pp,
                                      microbatches):
    skip_unless_schedulable(family, pp, microbatches)
    config = layout_config({**BASE, "train.global_batch_size": microbatches,
                            "parallel.schedule": family}, pp, pp=pp)
    results = dist.run(pp, record_pipeline, config, small_data_dir, STEPS, str(tmp_path))
    check(references(microbatches), results, f"{family} pp={pp} m={microbatches}")


# CI: data parallelism under the runtime's kinds of order, one family each (1F1B's full
# backwards, ZB-V's split ones on a V, interleaving, a wave, a searched order); every family
# has its own pipeline-only case above, and the reducer does not depend on which it is
DP_CI = ["1f1b", "zbv", "interleaved_1f1b", "hanayo"]  # search: its p4 case runs without dp


@pytest.mark.parametrize("family", matrix(FAMILIES, ci=DP_CI))
def test_pipeline_with_data_parallel_matches_one_process(dist, small_data_dir, references,
                                                         tmp_path, family):
    microbatches = 4  # per pipeline; valid for every family at p = 2 (DualPipeV needs 2p)
    config = layout_config({**BASE, "train.global_batch_size": 2 * microbatches,
                            "parallel.schedule": family}, 4, pp=2, dp_replicate=2)
    results = dist.run(4, record_pipeline, config, small_data_dir, STEPS, str(tmp_path))
    check(references(2 * microbatches), results, f"{family} pp=2 x dp=2")


@pytest.mark.matrix  # the runtime runs any placement's order alike: one wave is in CI, this in the matrix
def test_hanayo_with_two_waves_matches_one_process(dist, small_data_dir, references, tmp_path):
    # four sweeps over two ranks: 8 stages of one layer; m = 9 shares the CI cases' reference
    config = layout_config({**BASE, "train.global_batch_size": 9, "parallel.schedule": "hanayo",
                            "parallel.chunks": 4}, 2, pp=2)
    results = dist.run(2, record_pipeline, config, small_data_dir, STEPS, str(tmp_path))
    check(references(9), results, "hanayo chunks=4 pp=2 m=9")


# What ``loom plan`` writes for a searched schedule: a pinned placement, a limit between the
# families' levels and one F,I,W per rank (the last rank also runs the head)
PLANNED = [("looped", 3, "0.9,1.1,0.7;1,1.3,0.8,0.02"), ("v", 2, "0.95,1.2,0.7;1,1.3,0.8,0.05")]


@pytest.mark.parametrize("placement, limit, costs", PLANNED, ids=[p for p, _, _ in PLANNED])
def test_a_planned_searched_schedule_matches_one_process(dist, small_data_dir, references,
                                                        tmp_path, placement, limit, costs):
    microbatches = 5
    config = layout_config({**BASE, "train.global_batch_size": microbatches,
                            "parallel.schedule": "search",
                            "parallel.schedule_placement": placement,
                            "parallel.schedule_memory_limit": limit,
                            "parallel.schedule_costs": costs}, 2, pp=2)
    schedule = schedule_for("search", 2, microbatches, memory_limit=limit, costs=costs,
                            max_stages=BASE["model.n_layers"], placement=placement)
    assert schedule.chunks_per_rank == (2 if placement == "v" else 1)
    results = dist.run(2, record_pipeline, config, small_data_dir, STEPS, str(tmp_path))
    check(references(microbatches), results, f"search {placement} limit {limit}")


def test_the_loss_actually_moves(references):
    reference = references(4)
    assert reference["loss"][-1] < reference["loss"][0] - 0.1


# -- the command line -------------------------------------------------------------------------------


def loom(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "loom", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


# matrix: the pipeline runtime is the dist tests' above, and `loom train` runs pipelines in CI
# through tests/e2e/test_checkfree_relaunch.py and test_checkfree_plus_recovery.py
@pytest.mark.matrix
def test_loom_train_runs_a_zbv_pipeline(tmp_path):
    result = loom("train", "--nproc", "2", "--parallel.pp=2", "--parallel.schedule=zbv",
                  "--model.preset=debug", "--train.steps=2", "--train.global_batch_size=4",
                  "--train.micro_batch_size=1", "--data.seq_len=32", "--data.max_bytes=100000",
                  "--train.eval_every=2", "--optim.warmup_steps=1", "--metrics.tensorboard=false",
                  "--metrics.plot=false", "--train.run_dir=runs/pp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "runs" / "pp" / "model.safetensors").exists()


def test_loom_train_rejects_an_unschedulable_pipeline_before_starting(tmp_path):
    result = loom("train", "--nproc", "2", "--parallel.pp=2", "--parallel.schedule=dualpipev",
                  "--train.global_batch_size=2", "--train.micro_batch_size=1",
                  "--train.run_dir=runs/bad", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "parallel.schedule='dualpipev'" in result.stderr and "m = " in result.stderr
    assert not (tmp_path / "runs").exists()
