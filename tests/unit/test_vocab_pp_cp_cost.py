"""The estimators under vocabulary parallelism across the pipeline with context parallelism
(``parallel.vocab_parallel_pp`` with ``parallel.cp`` > 1, tests/dist/test_vocab_pp_cp.py): each
cp coordinate's pipeline runs the S and T passes and the split embedding of its own b·S/cp
tokens, and the rows' gradients are averaged over dp x cp (ZeRO: sharded over dp_shard x cp),
as the stages' are. Expected values written out by formula."""

from __future__ import annotations

import pytest

from loom.config import load_config, resolve
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import make_cluster
from loom.sim.collectives import allreduce_time, gather_time
from loom.sim.cost_model import CostModel
from loom.sim.vocab_cost import rows_data_parallel, rows_parameters
from loom.train.memory import _vocab_embedding_bytes, _vocab_pass_bytes

LLAMA = PRESETS["llama3-8b"]  # vocab 128,256, dim 4096, untied


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_rows_are_reduced_over_cp_too(zero):
    """pp 4 x cp 2 (x dp_shard 2 under ZeRO): the rows' collectives take in the cp ranks, as
    the stages' do: an all-reduce over dp x cp = 2 without ZeRO (nothing was priced before:
    dp = 1), ZeRO's reduce-scatter and all-gather over dp_shard x cp = 4; all exposed."""
    model = CostModel(LLAMA, 8192, 64, make_cluster("H100-SXM", 32, 8))
    shard = 2 if zero else 1
    lay = Layout(pp=4, cp=2, dp_shard=shard, zero_stage=zero, reshard_after_forward=zero != 3,
                 schedule="1f1b", microbatches=16, vocab_parallel_pp=True)
    rows = rows_parameters(LLAMA.vocab_size, LLAMA.dim, lay, LLAMA.tie_embeddings)
    c, strides = model.cluster, model.group_strides(lay)
    group = 2 * shard
    if zero:
        link = c.link_for(group, strides["shard"])
        gathered = 2 if zero == 3 else model.zero12_gather_bytes
        expected = gather_time(rows * 4, group, link) + gather_time(rows * gathered, group, link)
        links = {"shard_link": link, "rep_link": c.link_for(1, strides["rep"]),
                 "dp_link": c.link_for(group, strides["dp"])}
    else:
        link = c.link_for(group, strides["dp"])
        expected = allreduce_time(rows * 4, group, link)
        links = {"shard_link": c.link_for(group, strides["shard"]),
                 "rep_link": c.link_for(1, strides["rep"]), "dp_link": link}
    got = rows_data_parallel(rows, lay, grad_bytes=model.grad_bytes,
                             gather_bytes=model.e if zero == 3 else
                             model.zero12_gather_bytes, **links)
    assert got == pytest.approx(expected, rel=1e-12) and got > 0
    cost = model.evaluate(lay)
    assert cost.dp_exposed >= got and cost.comm["dp"] >= got


# the launch-time estimator: debug preset (vocab 320, dim 64), pp 4 x cp 2, 2 sequences of 32
V, D, B, S, CP = 320, 64, 2, 32, 2
SMALL = {"model.preset": "debug", "data.seq_len": str(S), "train.micro_batch_size": str(B),
         "train.global_batch_size": "8", "parallel.pp": "4", "parallel.cp": str(CP),
         "parallel.vocab_parallel_pp": "true"}


def test_the_estimators_passes_hold_a_cp_ranks_tokens():
    """N = b·S/cp = 32 tokens a microbatch: between S and T a rank holds [N, V/4] fp32
    exp-logits and the received [N, D] X; all step its M = 4 partial embeddings and as many
    [N, D] buffers (fp32), half of what cp = 1 holds."""
    config = resolve(load_config(None, SMALL), 8)
    tokens = B * S // CP
    assert _vocab_pass_bytes(config, final=False) == 4 * tokens * (V // 4) + 4 * tokens * D
    assert _vocab_embedding_bytes(config) == 4 * tokens * D * (4 + 4)
    whole = resolve(load_config(None, {**SMALL, "parallel.cp": "1"}), 4)
    assert _vocab_embedding_bytes(whole) == CP * _vocab_embedding_bytes(config)
