"""The planner's search tries the vocabulary split over the pipeline (``Layout.vocab_parallel_pp``)
where the trainer's rules allow it, and ``loom plan --layout`` refuses it where they do not.

The winning case: llama3-8b (128k vocabulary, untied) on 8 A100-40GB, one per node, 64
sequences of 8192: an 8-stage pipeline, whose last stage would carry the 128k head on top of its
layers. Torch-free, like the planner."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.cli import main
from loom.plan.hardware import make_cluster
from loom.plan.search import plan, runnable, simulate_step
from loom.plan.space import SCHEDULES, Workload, vocab_pp_fits
from loom.sim.collectives import allreduce_time, gather_time
from loom.sim.cost_model import CostModel
from loom.sim.vocab_cost import rows_data_parallel, rows_parameters

LLAMA = PRESETS["llama3-8b"]
CLUSTER = make_cluster("A100-40GB", 8, 1, inter="ndr-ib")
WORK = Workload("llama3-8b", LLAMA, 8192, 64)
# the families without the schedule search (whose twins the search does not price), no cp
SPACE = {"max_cp": 1, "schedules": {k: v for k, v in SCHEDULES.items() if k != "search"}}


@pytest.fixture(scope="module")
def chosen():
    # every finalist simulated, whatever the machine's load (the default is a wall-time budget)
    return plan(WORK, CLUSTER, top=5, space=SPACE, simulation_seconds=float("inf"))


def test_the_search_picks_the_vocabulary_split_where_the_head_weighs_on_the_last_stage(chosen):
    best = chosen.ranked[0]
    assert best.layout.vocab_parallel_pp and best.layout.pp == 8 and best.simulated
    model = CostModel(LLAMA, WORK.seq_len, WORK.global_batch, CLUSTER)
    plain = replace(best.layout, vocab_parallel_pp=False)
    without = simulate_step(model, model.evaluate(plain))
    assert best.step_time < without.step_time
    # and the trainer's rules accept it, at its real size
    assert runnable(best.layout, WORK) is None


def test_every_proposed_split_keeps_the_trainers_rules(chosen):
    for cost in chosen.ranked:
        lay = cost.layout
        if lay.vocab_parallel_pp:
            assert lay.ep == 1 and lay.pp > 1
            assert LLAMA.vocab_size % (lay.pp * lay.tp) == 0


def test_the_rules_on_the_axes():
    base = Layout(pp=4, dp_replicate=2, schedule="1f1b", microbatches=8)
    assert vocab_pp_fits(LLAMA, base)
    assert not vocab_pp_fits(LLAMA, replace(base, pp=1, dp_replicate=8))
    # ZeRO on dp_shard: the estimator holds ZeRO-3's rows gathered (tests/unit/
    # test_memory_vocab_pp.py), the cost model prices their reduction per stage (below)
    for zero in (1, 2, 3):
        assert vocab_pp_fits(LLAMA, replace(base, dp_replicate=1, dp_shard=2, zero_stage=zero))
    assert vocab_pp_fits(LLAMA, replace(base, dp_replicate=1, cp=2))  # rows over dp x cp
    assert not vocab_pp_fits(LLAMA, replace(base, dp_replicate=1, ep=2))
    assert not vocab_pp_fits(replace(LLAMA, vocab_size=LLAMA.vocab_size + 1), base)
    assert not vocab_pp_fits(replace(LLAMA, n_experts=8), base)


def test_no_split_where_the_vocabulary_does_not_divide():
    odd = replace(LLAMA, vocab_size=LLAMA.vocab_size + 1)  # 128,257: no pp divides it
    # on 80 GB parts, where plain layouts fit (on CLUSTER's 40 GB only the split does, once the
    # loss's backward is priced: loom.formulas.memory.loss_backward_bytes)
    roomy = make_cluster("A100-80GB", 8, 1, inter="ndr-ib")
    result = plan(replace(WORK, model=odd), roomy, top=5, space=SPACE)
    assert result.ranked
    assert not any(c.layout.vocab_parallel_pp for c in result.ranked)


ARGS = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100-SXM", "--seq", "8192",
        "--global-batch-tokens", "1048576", "--layout"]


@pytest.mark.parametrize("layout, field", [
    ("pp=4,dp_replicate=4,schedule=1f1b,microbatches=32,schedule_offload_limit=2",
     "parallel.schedule_offload_limit"),
    ("pp=1,dp_replicate=16", "parallel.vocab_parallel_pp"),
])
def test_layout_refuses_a_forbidden_split_naming_the_field(layout, field, capsys):
    assert main(ARGS + [layout + ",vocab_parallel_pp=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_layout_prices_an_allowed_split(capsys):
    layout = "pp=4,dp_replicate=4,schedule=zbv,chunks=2,microbatches=32,vocab_parallel_pp=true"
    assert main(ARGS + [layout]) == 0
    assert "vocab-pp" in capsys.readouterr().out


def test_an_explicit_layout_with_cp_is_priced(capsys):
    """The trainer runs the split under cp (tests/dist/test_vocab_pp_cp.py): ``--layout``
    prices it, as the search does (``vocab_pp_fits``)."""
    layout = "pp=4,dp_replicate=2,cp=2,schedule=1f1b,microbatches=64,vocab_parallel_pp=true"
    assert main(ARGS + [layout]) == 0
    assert "vocab-pp" in capsys.readouterr().out


def test_an_explicit_layout_with_zero_on_dp_shard_is_priced(capsys):
    """The trainer runs the split with ZeRO on dp_shard (tests/dist/test_vocab_pp_zero.py);
    ``--layout`` prices it as the search does (``vocab_pp_fits``)."""
    layout = "pp=4,dp_replicate=2,dp_shard=2,schedule=1f1b,microbatches=32"
    assert main(ARGS + [layout + ",vocab_parallel_pp=true"]) == 0
    assert "activations" in capsys.readouterr().out


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_rows_data_parallel_traffic_follows_the_zero_stage_exposed(zero):
    """The rows' collectives (``vocab_cost.rows_data_parallel``) by hand: ZeRO-3 one all-gather
    of the rows (bf16) and one reduce-scatter of their gradients (fp32) over dp_shard, ZeRO-1
    the reduce-scatter and the all-gather of the updated slices (Loom's fp32), without ZeRO an
    all-reduce over dp; HSDP adds the slices' all-reduce over dp_replicate. All of it exposed
    (after the schedule, or before it for ZeRO-3's gather), so the step's exposed
    data-parallel time is at least that."""
    model = CostModel(LLAMA, WORK.seq_len, WORK.global_batch, make_cluster("H100-SXM", 32, 8))
    shard = 2 if zero else 1
    lay = Layout(pp=4, dp_replicate=8 // shard, dp_shard=shard, zero_stage=zero,
                 reshard_after_forward=zero != 3, schedule="1f1b", microbatches=16,
                 vocab_parallel_pp=True)
    rows = rows_parameters(LLAMA.vocab_size, LLAMA.dim, lay, LLAMA.tie_embeddings)
    assert rows == 2 * 128_256 * 4096 / 4
    c, strides = model.cluster, model.group_strides(lay)
    shard_link = c.link_for(shard, strides["shard"])
    rep_link = c.link_for(8 // shard, strides["rep"])
    if zero:
        gathered = 2 if zero == 3 else model.zero12_gather_bytes
        expected = (gather_time(rows * 4, shard, shard_link) + gather_time(rows * gathered, shard,
                                                                          shard_link)
                    + allreduce_time(rows * 4 / shard, 8 // shard, rep_link))
    else:
        expected = allreduce_time(rows * 4, 8, c.link_for(8, strides["dp"]))
    got = rows_data_parallel(rows, lay, grad_bytes=model.grad_bytes,
                             gather_bytes=model.e if zero == 3 else
                             model.zero12_gather_bytes,
                             shard_link=shard_link, rep_link=rep_link,
                             dp_link=c.link_for(8, strides["dp"]))
    assert got == pytest.approx(expected, rel=1e-12) and got > 0
    # in the step: all of it exposed (the stages' reduction hides behind their backward)
    cost = model.evaluate(lay)
    assert cost.dp_exposed >= got and cost.comm["dp"] >= got


@pytest.mark.parametrize("zero", [1, 3])
def test_the_planners_model_state_is_the_estimators_with_zero(zero):
    """pp 2 x dp_shard 2, bf16, the debug model (V/2 = 160 rows of 64 a rank): the planner's
    parameters, gradients and optimizer state at its worst instant are the launch-time
    estimator's. ZeRO-3: the shards (4Ψ/2, FSDP2's fp32) and every parameter of the rank whole
    in bf16 (the stage held, the rows gathered: 2Ψ); ZeRO-1: bf16 parameters (2Ψ) and the
    masters and moments sliced (12Ψ/2)."""
    # the estimator's modules here only: the rest of this file stays torch-free
    from loom.config import load_config, resolve
    from loom.train.memory import estimate_memory

    config = resolve(load_config(None, {
        "model.preset": "debug", "data.seq_len": "32", "train.micro_batch_size": "2",
        "train.global_batch_size": "8", "train.dtype": "bf16", "parallel.pp": "2",
        "parallel.dp_shard": "2", "parallel.zero_stage": str(zero),
        "parallel.reshard_after_forward": str(zero != 3).lower(),
        "parallel.vocab_parallel_pp": "true"}), 4)
    expected = estimate_memory(config)
    model = CostModel(config.model, seq_len=32, global_batch=8,
                      cluster=make_cluster("H100-SXM", 4, 4))
    got = model.memory(Layout(pp=2, dp_shard=2, zero_stage=zero, reshard_after_forward=zero != 3,
                              vocab_parallel_pp=True, micro_batch=2, microbatches=2,
                              schedule="1f1b"))
    psi = 2 * 36_992 + 2 * 160 * 64 + 64  # two layers, the rows, the final norm (last rank)
    assert got["parameters"] == expected.parameters == (4 * psi if zero == 3 else 2 * psi)
    assert got["optimizer"] == expected.optimizer == (8 * psi / 2 if zero == 3 else 12 * psi / 2)
