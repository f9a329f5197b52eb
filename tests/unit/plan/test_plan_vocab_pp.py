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
from loom.sim.cost_model import CostModel

LLAMA = PRESETS["llama3-8b"]
CLUSTER = make_cluster("A100-40GB", 8, 1, inter="ndr-ib")
WORK = Workload("llama3-8b", LLAMA, 8192, 64)
# the families without the schedule search (whose twins the search does not price), no cp
SPACE = {"max_cp": 1, "schedules": {k: v for k, v in SCHEDULES.items() if k != "search"}}


@pytest.fixture(scope="module")
def chosen():
    return plan(WORK, CLUSTER, top=5, space=SPACE)


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
            assert lay.dp_shard == 1 and lay.cp == 1 and lay.ep == 1 and lay.pp > 1
            assert LLAMA.vocab_size % (lay.pp * lay.tp) == 0


def test_the_rules_on_the_axes():
    base = Layout(pp=4, dp_replicate=2, schedule="1f1b", microbatches=8)
    assert vocab_pp_fits(LLAMA, base)
    assert not vocab_pp_fits(LLAMA, replace(base, pp=1, dp_replicate=8))
    assert not vocab_pp_fits(LLAMA, replace(base, dp_replicate=1, dp_shard=2))
    assert not vocab_pp_fits(LLAMA, replace(base, dp_replicate=1, cp=2))
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
    ("pp=4,dp_replicate=2,cp=2,schedule=1f1b,microbatches=32", "parallel.cp"),
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


def test_an_explicit_layout_with_zero_on_dp_shard_is_priced(capsys):
    """The trainer runs the split with ZeRO on dp_shard (tests/dist/test_vocab_pp_zero.py);
    ``--layout`` prices it (the search leaves it out: ``vocab_pp_fits``)."""
    layout = "pp=4,dp_replicate=2,dp_shard=2,schedule=1f1b,microbatches=32"
    assert main(ARGS + [layout + ",vocab_parallel_pp=true"]) == 0
    assert "activations" in capsys.readouterr().out
