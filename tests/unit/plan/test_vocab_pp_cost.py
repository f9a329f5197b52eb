"""The planner's pricing of vocabulary parallelism across the pipeline
(``Layout.vocab_parallel_pp``, ``loom.parallel.vocab_pipeline``): each rank runs 1/p of the
head as its S and T passes, the last stage's compute no longer carries the head, and every rank
holds V/(pp x tp) rows of the embedding and of the head. Expected values are written out from
the alpha-beta formulas and the head's share, on a 128k-vocabulary model (llama3-8b, untied)."""

from __future__ import annotations

from dataclasses import replace

from pytest import approx

from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_memory import layout_memory
from loom.sim.cost_model import CostModel, allreduce_time, gather_time, p2p_time
from loom.sim.pipeline_estimate import pipeline_estimate

LLAMA = PRESETS["llama3-8b"]  # vocab 128,256, dim 4096, untied
FAST = Link("fast", 100 * GB, 1e-6, efficiency=1.0)
SLOW = Link("slow", 10 * GB, 1e-5, efficiency=1.0)
UNIT = Gpu("unit", peak_flops=1e15, memory_bytes=80 * 2**30, hbm_bandwidth=3e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
P, MB, SEQ = 4, 1, 4096
BASE = Layout(pp=P, dp_replicate=2, schedule="1f1b", micro_batch=MB, microbatches=8)
SPLIT = replace(BASE, vocab_parallel_pp=True)


def model() -> CostModel:
    # every group inside one 64-GPU node: all links are FAST
    return CostModel(LLAMA, seq_len=SEQ, global_batch=16, cluster=Cluster(UNIT, 8, 64, FAST, SLOW))


def test_every_rank_runs_a_pth_of_the_head_and_the_last_no_more():
    """Per microbatch, a middle stage adds 1/p of the head's F + I + W and the all-gather of the
    [3, N] fp32 statistics over pp; the last stage drops the whole head for the same, plus X
    sent to the p - 1 other ranks and their parts of dX received (N x D x 2 bytes each)."""
    cm = model()
    plain, split = cm.evaluate_ops(BASE), cm.evaluate_ops(SPLIT)
    head = sum(cm._head_times(BASE))
    tokens = MB * SEQ
    stats = gather_time(4 * 3 * tokens * P, P, FAST)
    x = tokens * LLAMA.dim * 2
    hops = 2 * (P - 1) * p2p_time(x, FAST) + allreduce_time(4 * tokens * LLAMA.dim, 1, FAST)
    for s in range(P - 1):
        assert sum(split[s]) == approx(sum(plain[s]) + head / P + stats, rel=1e-12)
    assert sum(split[-1]) == approx(sum(plain[-1]) - head + head / P + stats + hops, rel=1e-12)
    assert sum(split[-1]) < sum(plain[-1]) - 0.5 * head  # the head's share, not its messages
    # the stage's F carries S (1/p of the head's forward) and sending X
    assert split[-1][0] == approx(plain[-1][0] - cm._head_times(BASE)[0] * (1 - 1 / P)
                                  + (P - 1) * p2p_time(x, FAST), rel=1e-12)


def test_the_step_prices_the_embedding_messages_at_its_edges():
    """The split embedding: every rank's partial embedding into the first stage and its input
    gradient back, p - 1 messages of N x D x 2 bytes each way per microbatch, exposed."""
    cm = model()
    x = MB * SEQ * LLAMA.dim * 2
    edges = 2 * (P - 1) * p2p_time(x, FAST) * BASE.microbatches
    step = cm.evaluate(SPLIT)
    ops, busiest = cm._ops_and_busiest(SPLIT)
    assert step.pipeline == approx(pipeline_estimate(SPLIT, ops, busiest, cm.send_time(SPLIT))
                                   + edges, rel=1e-12)


def test_the_last_rank_no_longer_holds_the_head():
    """Model state: the last rank's parameters drop from the whole head (V x D) to V/p rows of
    the embedding and of the head (bf16 parameters: 2 bytes each); its peak drops too (no
    [N, V] logits), and the first rank's holds V/p x 2 rows instead of the whole embedding."""
    cm = model()
    vocab = LLAMA.vocab_size * LLAMA.dim
    rows = vocab / P
    plain, split = cm.ranks.end_rank_params(BASE), cm.ranks.end_rank_params(SPLIT)
    assert split[P - 1] == plain[P - 1] - vocab + 2 * rows
    assert split[0] == plain[0] - vocab + 2 * rows
    last_plain = layout_memory(cm, BASE, rank=P - 1)
    last_split = layout_memory(cm, SPLIT, rank=P - 1)
    assert last_split["parameters"] == approx(last_plain["parameters"] - 2 * (vocab - 2 * rows))
    assert sum(last_split.values()) < sum(last_plain.values())


def test_flag_off_prices_as_before():
    """vocab_parallel_pp = false (or pp = 1, where it means nothing) leaves every number as
    the layout without the field."""
    cm = model()
    flat = Layout(dp_replicate=8, micro_batch=1, microbatches=2)
    for lay in (BASE, flat):
        a, b = cm.evaluate(lay), cm.evaluate(replace(lay, vocab_parallel_pp=lay.pp == 1))
        assert (a.pipeline, a.memory) == (b.pipeline, b.memory)
