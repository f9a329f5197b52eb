"""The planner's cost model against hand-derived FLOPs, memory and alpha-beta formulas.

Each expected value is written out from the formula in ``loom/sim/cost_model.py``'s docstring
(or REFERENCE.md), not computed by the code under test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.config import load_config, resolve
from loom.models.layers import TransformerArgs
from loom.models.presets import PRESETS, parameter_count
from loom.schedule import families as schedules
from loom.schedule.validate import peak_memory
from loom.plan.hardware import GB, Cluster, Gpu, Link, make_cluster
from loom.plan.space import SCHEDULES
from loom.layout import Layout
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM
from loom.sim.cost_memory import PEAK_IN_FLIGHT
from loom.sim.collectives import (all_to_all_time, allreduce_time, gather_time, p2p_time,
                                  spanning_all_to_all_time)
from loom.formulas.flops import training_flops_per_token
from loom.train.memory import estimate_memory

# debug shape: h 64, 4 layers, 4 heads (d 16), 2 KV heads, FFN 128, vocab 320
DEBUG = PRESETS["debug"]
FAST = Link("fast", 100 * GB, 1e-6, efficiency=1.0)
SLOW = Link("slow", 10 * GB, 1e-5, efficiency=1.0)
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)


def cluster(gpus: int, per_node: int = 8) -> Cluster:
    return Cluster(UNIT, gpus, per_node, FAST, SLOW)


def test_layer_flops_by_hand():
    model = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=cluster(1))
    tokens = 2 * 32
    # projections 2T·h·d·(2a + 2k), SwiGLU 6T·h·f; attention core 4T·s·a·d halved (causal)
    proj = 2 * tokens * 64 * 16 * (2 * 4 + 2 * 2)
    mlp = 6 * tokens * 64 * 128
    core = 4 * tokens * 32 * 4 * 16 / 2
    assert model.layer_flops(tokens, 1, moe=False) == (proj + mlp, core)
    assert model.layer_flops(tokens, 2, moe=False) == ((proj + mlp) / 2, core / 2)


def test_moe_layer_flops_count_routed_and_shared_experts():
    moe = PRESETS["tiny-moe"]  # h 64, 4 experts top-2 of width 64, 1 shared expert
    model = CostModel(moe, seq_len=16, global_batch=4, cluster=cluster(1))
    proj = 2 * 10 * 64 * 16 * (2 * 4 + 2 * 2)
    experts = 6 * 10 * 64 * 64 * (2 + 1)
    router = 2 * 10 * 64 * 4
    matmul, _ = model.layer_flops(10, 1, moe=True)
    assert matmul == proj + experts + router


def test_model_flops_equal_the_mfu_convention():
    """MFU's numerator is loom.train.flops' per-token count (6N + 12·l·s·a·d) times tokens."""
    for name, seq in (("debug", 32), ("llama3-8b", 8192), ("gpt3-175b", 2048)):
        m = PRESETS[name]
        model = CostModel(m, seq_len=seq, global_batch=4, cluster=cluster(1))
        per_token = training_flops_per_token(
            dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
            head_dim=m.head_dim, ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, seq_len=seq,
            mlp_matrices=m.mlp_matrices)  # gpt3-175b: GELU, 2 matrices
        assert model.model_flops_per_step() == pytest.approx(per_token * 4 * seq, rel=1e-12)


def test_full_recompute_costs_one_more_forward():
    """Megatron's hardware FLOPs with full recomputation are 4/3 of the model FLOPs (eq. 3 of
    Narayanan et al. 2021 over eq. 7 of Korthikanti et al. 2022: 96 / 72)."""
    model = CostModel(PRESETS["gpt3-175b"], seq_len=2048, global_batch=8, cluster=cluster(8))
    cost = model.evaluate(Layout(tp=8, recompute="full"))
    assert cost.hardware_flops == pytest.approx(cost.model_flops * 4 / 3)


def test_every_kth_block_recomputed_costs_its_share_of_a_forward():
    """``every_k``: blocks 0, k, 2k, ... run their forward again in backward, as the trainer
    recomputes them. The debug model's 4 blocks at k = 2: blocks 0 and 2, so a layer's input
    gradient pass costs half a forward more than without recomputation (k = 1 is full
    recomputation), and the hardware FLOPs are the model's x (1 + 1/3 x 2/4); at k = 3,
    blocks 0 and 3."""
    model = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=cluster(1))
    base = Layout(micro_batch=2, microbatches=4)
    f, i_none, _, _ = model._layer_times(base, False)
    for k, share in ((1, 1.0), (2, 0.5), (3, 0.5), (4, 0.25)):
        lay = replace(base, recompute="every_k", recompute_every=k)
        assert model._layer_times(lay, False)[1] == pytest.approx(i_none + share * f), k
        cost = model.evaluate(lay)
        assert cost.hardware_flops == pytest.approx(cost.model_flops * (1 + share / 3)), k
    full = model._layer_times(replace(base, recompute="full"), False)
    assert model._layer_times(replace(base, recompute="every_k", recompute_every=1),
                              False) == full


@pytest.mark.parametrize("name", ["debug", "llama3-8b", "gpt3-175b", "tiny-moe"])
def test_parameters_on_one_rank_equal_the_preset_count(name):
    m = PRESETS[name]
    model = CostModel(m, seq_len=64, global_batch=4, cluster=cluster(1))
    assert model.ranks.end_rank_params(Layout())[0] == parameter_count(m)


@pytest.mark.parametrize("stage, factor", [(0, (2, 4, 12)), (2, (2, 4 / 8, 12 / 8)),
                                           (3, (4 / 8, 4 / 8, 8 / 8))])
def test_model_state_follows_the_zero_formulas(stage, factor):
    """Loom's bf16 (the planner's 2-byte default): (parameters, gradients, optimizer) =
    (2, 4, 12)·Ψ, bf16 parameters, fp32 gradients, fp32 masters with AdamW's moments, the
    gradients from ZeRO-2 and the optimizer state from ZeRO-1 on divided by the shard degree
    (Megatron's distributed optimizer); ZeRO-3 is FSDP2's (4, 4, 8)·Ψ/N_d, its sharded fp32
    parameters the masters. At the peak too: ZeRO-2's packing buffers are transient
    (``loom.train.memory.zero2_reduction_bytes``) and with one microbatch no full-size
    gradient is ever held; ZeRO-3's peak is the backward's start, before any gradient but the
    head's (zero_grad freed the shards), the debug model's activations outweighing them."""
    psi = parameter_count(DEBUG)
    model = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=cluster(8))
    shard = 8 if stage else 1
    memory = model.memory(Layout(dp_shard=shard, dp_replicate=8 // shard, zero_stage=stage))
    grads = 4 * 320 * 64 / 8 if stage == 3 else factor[1] * psi  # the head's gradient shard
    assert (memory["parameters"], memory["gradients"], memory["optimizer"]) == \
        pytest.approx((factor[0] * psi, grads, factor[2] * psi))


@pytest.mark.parametrize("parallel, layout", [
    ({}, Layout(micro_batch=2, microbatches=4)),
    ({"parallel.tp": "2", "parallel.sequence_parallel": "true"},
     Layout(tp=2, sequence_parallel=True, micro_batch=2, microbatches=4)),
    ({"parallel.tp": "2"}, Layout(tp=2, micro_batch=2, microbatches=4)),
    ({"parallel.cp": "2"}, Layout(cp=2, micro_batch=2, microbatches=4)),
    ({"train.recompute": "selective"}, Layout(micro_batch=2, microbatches=4,
                                              recompute="selective")),
    ({"train.recompute": "full"}, Layout(micro_batch=2, microbatches=4, recompute="full")),
    ({"train.recompute": "every_k", "train.recompute_every": "2"},
     Layout(micro_batch=2, microbatches=4, recompute="every_k", recompute_every=2)),
    ({"train.recompute": "every_k", "train.recompute_every": "3"},
     Layout(micro_batch=2, microbatches=4, recompute="every_k", recompute_every=3)),
    ({"parallel.dp_shard": "2", "parallel.dp_replicate": "1"},
     Layout(dp_shard=2, zero_stage=3, micro_batch=2, microbatches=2)),
    ({"parallel.dp_shard": "2", "parallel.dp_replicate": "1", "train.global_batch_size": "4"},
     Layout(dp_shard=2, zero_stage=3, micro_batch=2, microbatches=1)),
    ({"parallel.dp_shard": "2", "parallel.dp_replicate": "1", "parallel.zero_stage": "2",
      "train.global_batch_size": "4"},
     Layout(dp_shard=2, zero_stage=2, micro_batch=2, microbatches=1)),
    ({"parallel.dp_shard": "2", "parallel.dp_replicate": "1", "parallel.cp": "2",
      "parallel.zero_stage": "2"},  # ZeRO shards over dp_shard x cp
     Layout(dp_shard=2, cp=2, zero_stage=2, micro_batch=2, microbatches=2)),
])
def test_memory_equals_the_estimator(parallel, layout):
    """Without a pipeline the planner's memory is the launch-time estimator's (measured within
    2% of allocated bytes, docs/benchmarks.md), component by component."""
    config = resolve(load_config(None, {"model.preset": "debug", "data.seq_len": "32",
                                        "train.micro_batch_size": "2",
                                        "train.global_batch_size": "8", "train.dtype": "bf16",
                                        **parallel}), layout.world)
    expected = estimate_memory(config)
    model = CostModel(config.model, seq_len=32, global_batch=config.train.global_batch_size,
                      cluster=cluster(layout.world))
    got = model.memory(layout)
    for name in ("parameters", "gradients", "optimizer", "activations", "transient"):
        assert got[name] == pytest.approx(getattr(expected, name), rel=1e-9), name


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"search"}
                                         | {"gpipe", "looped_bfs", "dualpipev"}))
def test_peak_in_flight_closed_forms_match_the_validator(name):
    chunks = SCHEDULES.get(name, (2 if name != "gpipe" else 1,))
    for p in range(2, 9):
        sizes = {"dualpipev": (2 * p, 2 * p + 1, 3 * p), "interleaved_1f1b": (p, 2 * p, 3 * p)}
        for m in sizes.get(name, (p, p + 1, 2 * p + 1, 3 * p)):
            for v in chunks:
                generator = schedules.get(name)
                schedule = generator(p, m, chunks=v) if name == "interleaved_1f1b" \
                    else generator(p, m)
                v = schedule.chunks_per_rank
                assert PEAK_IN_FLIGHT[name](p, m, v) == pytest.approx(
                    float(max(peak_memory(schedule)))), (name, p, m, v)


def test_alpha_beta_collectives_by_hand():
    link = Link("l", 10 * GB, 1e-5, efficiency=0.5)  # 5 GB/s effective
    beta, alpha, nbytes = 5 * GB, 1e-5, 1e9
    ring = 2 * 7 / 8 * nbytes / beta + 2 * 7 * alpha
    tree = 2 * nbytes / beta + 2 * 3 * alpha
    assert allreduce_time(nbytes, 8, link) == pytest.approx(min(ring, tree))
    assert gather_time(nbytes, 8, link) == pytest.approx(7 / 8 * nbytes / beta + 7 * alpha)
    assert all_to_all_time(nbytes, 4, link) == pytest.approx(3 / 4 * nbytes / beta + 3 * alpha)
    assert p2p_time(nbytes, link) == pytest.approx(alpha + nbytes / beta)
    assert allreduce_time(nbytes, 1, link) == 0.0
    # small messages on many ranks: the tree's log2(n) latency wins
    assert allreduce_time(8, 1024, link) == pytest.approx(2 * 8 / beta + 2 * 10 * alpha)


def test_an_all_to_all_across_nodes_sends_its_node_s_share_over_the_fast_link_at_once():
    """16 ranks, 8 a node: each rank sends 1/16 of its bytes to each member, 7 of them in its
    node (fast link) and 8 in the other (its NIC), both at once; the latency is the slow
    link's, once per peer. Inside a node it is the one-link form; one member per node sends
    everything but its own share over the NIC."""
    c = cluster(32, per_node=8)
    nbytes = 1e9
    fast, slow = FAST.effective_bandwidth, SLOW.effective_bandwidth
    expected = max(7 / 16 * nbytes / fast, 8 / 16 * nbytes / slow) + 15 * SLOW.latency
    assert spanning_all_to_all_time(nbytes, 16, 1, c) == pytest.approx(expected)
    assert spanning_all_to_all_time(nbytes, 16, 1, c) < all_to_all_time(nbytes, 16, SLOW)
    assert spanning_all_to_all_time(nbytes, 8, 1, c) == all_to_all_time(nbytes, 8, FAST)
    # stride 8: one member a node, every other member's share crosses a NIC
    assert spanning_all_to_all_time(nbytes, 4, 8, c) == all_to_all_time(nbytes, 4, SLOW)
    # stride 2: 4 members a node, so 3/8 of the bytes stay in the node and 4/8 leave it
    assert spanning_all_to_all_time(nbytes, 8, 2, c) == pytest.approx(
        max(3 / 8 * nbytes / fast, 4 / 8 * nbytes / slow) + 7 * SLOW.latency)
    assert spanning_all_to_all_time(nbytes, 1, 1, c) == 0.0


def test_groups_inside_a_node_use_the_fast_link():
    c = cluster(32, per_node=8)
    assert c.link_for(8, 1) is FAST  # tp 8 on one node
    assert c.link_for(2, 4) is FAST  # 2 ranks 4 apart: ranks 0 and 4
    assert c.link_for(4, 8) is SLOW  # one rank per node
    assert c.link_for(16, 1) is SLOW


def test_tensor_parallel_communication_is_four_all_reduces_per_layer():
    """Megatron: 2 all-reduces of b·s·h forward and 2 backward per layer (8bsh(t-1)/t bytes
    per element size, REFERENCE.md §1.1), not overlapped: F and I each carry two."""
    m = TransformerArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=4096,
                        vocab_size=1024)
    model = CostModel(m, seq_len=512, global_batch=2, cluster=cluster(8), dtype_bytes=2,
                      framework=LOOM.compiled_as(True))  # the fused passes only
    f1, i1, w1, _ = model._layer_times(Layout(tp=1), moe=False)
    f4, i4, w4, comm = model._layer_times(Layout(tp=4), moe=False)
    one = allreduce_time(1 * 512 * 1024 * 2, 4, FAST)
    assert comm["tp"] == pytest.approx(4 * one)
    # compute splits by 4 (the unit GPU runs every matmul at peak); elementwise 8 + 12/t passes
    elementwise = lambda t: 512 * 1024 * 2 * (8 + 12 / t) / 1e12  # noqa: E731
    assert f4 - 2 * one - elementwise(4) == pytest.approx((f1 - elementwise(1)) / 4)
    assert w4 == pytest.approx(w1 / 4)


def test_single_rank_step_is_the_sum_of_its_passes():
    model = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=cluster(1))
    lay = Layout(micro_batch=2, microbatches=4)
    cost = model.evaluate(lay)
    f, i, w, _ = model._layer_times(lay, moe=False)
    head = model._head_times(lay)
    per_microbatch = 4 * (f + i + w) + sum(head)
    assert cost.pipeline == pytest.approx(4 * per_microbatch)
    assert cost.dp_exposed == 0 and cost.bubble == 0


def test_data_parallel_reduction_hides_behind_the_last_backward():
    """The all-reduce of 4-byte gradients overlaps the last microbatch's backward (I + W of
    every layer and the head), one piece per layer queued on the link as that layer's backward
    ends (``loom.sim.streams``): the first cannot start before one layer's backward is done, so
    the excess over the other n - 1 layers, and at least one layer's bucket, is exposed."""
    m = PRESETS["llama3-8b"]
    model = CostModel(m, seq_len=4096, global_batch=64, cluster=make_cluster("H100-SXM", 64, 8))
    lay = Layout(dp_replicate=64, micro_batch=1, microbatches=1)
    cost = model.evaluate(lay)
    total = allreduce_time(parameter_count(m) * 4, 64, model.cluster.inter)
    assert cost.comm["dp"] == pytest.approx(total)
    _, i, w, _ = model._layer_times(lay, moe=False)
    _, head_i, head_w = model._head_times(lay)
    backward = m.n_layers * (i + w) + head_i + head_w
    n = m.n_layers
    assert cost.dp_exposed == pytest.approx(max(total / n, total - backward * (n - 1) / n))


# ----- a CPU profile: ranks sharing cores, and the framework work of the wrappers -------------
def test_ranks_sharing_cores_compute_slower_by_ranks_over_cores():
    """4 ranks on 2 cores: every pass of a layout without a pipeline takes twice as long, the
    communication does not (it was measured with every rank taking part)."""
    from dataclasses import replace

    shared = replace(UNIT, cores=2.0)
    own = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=Cluster(UNIT, 4, 4, FAST, SLOW))
    two = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=Cluster(shared, 4, 4, FAST, SLOW))
    assert (own.contention, two.contention) == (1.0, 2.0)
    dp = Layout(dp_replicate=4, micro_batch=2, microbatches=1)
    assert two._layer_times(dp, False)[:3] == pytest.approx(
        tuple(2 * t for t in own._layer_times(dp, False)[:3]))
    tp = Layout(tp=4, micro_batch=2, microbatches=4)
    f_own, _, w_own, comm = own._layer_times(tp, False)
    f_two, _, w_two, _ = two._layer_times(tp, False)
    assert f_two - comm["tp"] / 2 == pytest.approx(2 * (f_own - comm["tp"] / 2))
    assert w_two == pytest.approx(2 * w_own)
    # a pipeline's passes stay uncontended: its simulation shares the cores among busy ranks
    pp = Layout(pp=2, dp_replicate=2, schedule="1f1b", micro_batch=2, microbatches=4)
    assert two._layer_times(pp, False)[:3] == own._layer_times(pp, False)[:3]
    assert (two.shared_cores(pp), own.shared_cores(pp)) == (1.0, 0.0)  # 2 pipelines, 2 cores


def test_ranks_sharing_cores_hide_no_communication_behind_compute():
    """With a processor per rank the gradient all-reduce hides behind the backward and ring
    attention's passes behind its blocks; with 4 ranks on 2 cores every core is computing, so
    the collectives' own work adds to the step in full."""
    from dataclasses import replace

    own = CostModel(DEBUG, seq_len=32, global_batch=8, cluster=Cluster(UNIT, 4, 4, FAST, SLOW))
    two = CostModel(DEBUG, seq_len=32, global_batch=8,
                    cluster=Cluster(replace(UNIT, cores=2.0), 4, 4, FAST, SLOW))
    assert own.overlaps and not two.overlaps
    dp = Layout(dp_replicate=4, micro_batch=2, microbatches=1)
    hidden, shared = own.evaluate(dp), two.evaluate(dp)
    assert shared.comm["dp"] == pytest.approx(hidden.comm["dp"])
    assert shared.dp_exposed == pytest.approx(shared.comm["dp"])  # all of it
    assert hidden.dp_exposed < hidden.comm["dp"]
    # ZeRO-3: every gather and the reduce-scatter add to the step, each once (not one more)
    zero3 = Layout(dp_shard=4, zero_stage=3, micro_batch=2, microbatches=2)
    shared = two.evaluate(zero3)
    assert shared.dp_exposed == pytest.approx(shared.comm["dp"])
    ring = Layout(cp=4, micro_batch=2, microbatches=1)
    kv = 2 * (2 * 8) * DEBUG.n_kv_heads * DEBUG.head_dim * 2  # K and V, 2 x 8 local tokens, bf16
    assert two._layer_times(ring, False)[3]["cp"] == pytest.approx(
        3 * (p2p_time(kv, FAST) + p2p_time(2 * kv, FAST)))


def test_shared_core_pipeline_simulation_is_the_shared_replay():
    """With one core per pipeline rank the shared replay is the simulator; with fewer, the
    planner's pipeline time is ``replay_shared`` of the same schedule and costs."""
    from dataclasses import replace

    from loom.schedule.simulate import replay_shared
    from loom.plan.search import simulate_step

    lay = Layout(pp=2, dp_replicate=2, schedule="1f1b", micro_batch=2, microbatches=4)
    plenty = CostModel(DEBUG, 32, 16, Cluster(replace(UNIT, cores=4.0), 4, 4, FAST, SLOW))
    own = CostModel(DEBUG, 32, 16, Cluster(UNIT, 4, 4, FAST, SLOW))
    assert simulate_step(plenty, plenty.evaluate(lay)).pipeline == pytest.approx(
        simulate_step(own, own.evaluate(lay)).pipeline)
    half = CostModel(DEBUG, 32, 16, Cluster(replace(UNIT, cores=2.0), 4, 4, FAST, SLOW))
    cost = half.evaluate(lay)
    schedule = schedules.get("1f1b")(2, 4)
    costs = cost.stage_costs.build()
    work = {a: costs.duration(a) for row in schedule.actions for a in row}
    expected = replay_shared(schedule, work, costs.latency, 1.0)
    assert simulate_step(half, cost).pipeline == pytest.approx(expected)
    assert expected > simulate_step(own, own.evaluate(lay)).pipeline


def test_framework_work_is_charged_per_wrapper():
    """Each layer pass pays the per-pass work of every wrapper the layout uses, each step the
    per-step work; a wrapper the layout does not use costs nothing."""
    from dataclasses import replace

    from loom.sim.cost_model import wrappers

    assert wrappers(Layout(dp_replicate=4)) == ("base",)
    assert wrappers(Layout(tp=2, dp_shard=2, zero_stage=3)) == ("base", "tp", "zero3")
    assert wrappers(Layout(cp=4, cp_mode="hybrid", dp_shard=2, zero_stage=1)) == \
        ("base", "zero1", "ring", "ulysses")
    assert wrappers(Layout(dp_shard=2, zero_stage=2)) == ("base", "zero2")
    # a profile from before ZeRO-1 and ZeRO-2 were probed apart charges both its "zero12"
    old = replace(UNIT, framework=(("zero12", 1e-3, 0.1, 0.0),))
    assert old.framework_overhead(("base", "zero1")) == old.framework_overhead(("zero2",)) == \
        (1e-3, 0.1, 0.0)
    assert wrappers(Layout(pp=2, schedule="1f1b")) == ("base", "pp")
    table = (("base", 1e-3, 0.1, 1e-6), ("tp", 2e-3, 0.2, 2e-6), ("zero3", 5e-3, 0.5))
    plain = CostModel(DEBUG, 32, 8, Cluster(UNIT, 4, 4, FAST, SLOW))
    charged = CostModel(DEBUG, 32, 8, Cluster(replace(UNIT, framework=table), 4, 4, FAST, SLOW))
    tokens = 2 * 32  # micro-batch 2 of 32 tokens
    for lay, per_pass, per_step in ((Layout(tp=4, micro_batch=2), 3e-3 + 3e-6 * tokens, 0.3),
                                    (Layout(dp_replicate=4, micro_batch=2), 1e-3 + 1e-6 * tokens,
                                     0.1)):
        with_work, without = charged._layer_times(lay, False), plain._layer_times(lay, False)
        for k in range(3):
            assert with_work[k] - without[k] == pytest.approx(per_pass)
        assert charged.evaluate(lay).optimizer - plain.evaluate(lay).optimizer == \
            pytest.approx(per_step)


def test_all_gather_context_parallelism_pays_its_three_collectives_unhidden():
    """cp_mode allgather (loom.parallel.allgather_attention): per layer and microbatch, the
    keys and values of every cp rank all-gathered forward and again backward, and their fp32
    gradients reduce-scattered; none of it hidden behind the attention, where the ring's hops
    are. The same bytes cross as on the ring, so with the ring's overlap off the two agree up
    to the collectives' latency terms."""
    from loom.sim.collectives import gather_time

    m = PRESETS["llama3-8b"]
    cluster = make_cluster("H100-SXM", 8, 8)
    model = CostModel(m, 8192, 8, cluster)
    ring = model.evaluate(Layout(cp=8, cp_mode="ring", dp_replicate=1, micro_batch=1,
                                 microbatches=8))
    gather = model.evaluate(Layout(cp=8, cp_mode="allgather", dp_replicate=1, micro_batch=1,
                                   microbatches=8))
    tokens = 8192 // 8
    kv_all = 2 * tokens * m.n_kv_heads * m.head_dim * model.e * 8
    link = cluster.link_for(8, 1)
    per_layer = (2 * gather_time(kv_all, 8, link)
                 + gather_time(kv_all * 4 / model.e, 8, link))
    assert gather.comm["cp"] == pytest.approx(per_layer * m.n_layers * 8, rel=1e-9)
    assert gather.step_time > ring.step_time  # the ring hides its hops behind the blocks


def test_hanayo_peak_in_flight_matches_the_validator_for_every_wave_count():
    """One wave holds 1F1B's p; more waves (v = 2W sweeps) the measured closed form, m >= 4p."""
    for p in range(2, 9):
        for v in (2, 4, 6):
            for m in (4 * p, 5 * p + 1):
                schedule = schedules.get("hanayo")(p, m, chunks=v)
                assert PEAK_IN_FLIGHT["hanayo"](p, m, v) == pytest.approx(
                    float(max(peak_memory(schedule)))), (p, m, v)
