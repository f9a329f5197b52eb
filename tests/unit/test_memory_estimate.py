"""The memory estimator against hand-derived numbers, and the launch refusal."""

from __future__ import annotations

import pytest
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from loom.cli import main
from loom.config import load_config, resolve
from loom.formulas.memory import FUSED_ADAMW_DEVICES, adamw_step_fused
from loom.train.memory import (check_memory_limit, estimate_memory, layer_activation_bytes,
                               memory_instants)

# debug preset, byte tokenizer (vocab 257 -> 320): one layer = wq 4096 + wk 2048 + wv 2048 +
# wo 4096 + norms 128 + SwiGLU 3*64*128 = 36,992; 4 layers + embedding 20,480 + head 20,480 +
# final norm 64 = 188,992 parameters.
PSI = 188_992
SMALL = {"model.preset": "debug", "data.seq_len": "32", "train.micro_batch_size": "2",
         "train.global_batch_size": "8"}


def config(world: int, **overrides):
    return resolve(load_config(None, {**SMALL, **overrides}), world)


def forward_peak(cfg, rank: int = 0):
    """The instant of ``rank``'s most saved activations (the largest total among ties): the
    peak of a model whose activations outweigh its state (the debug model's do not). Not the
    loss's backward, whose fp32 gradients are transient (``test_memory_loss_path``)."""
    mine = [e for e in memory_instants(cfg) if e.rank == rank
            and not any("ZeRO-2 reduction" in note or "loss's backward" in note
                        for note in e.notes)]
    most = max(e.activations for e in mine)
    return max((e for e in mine if e.activations == most), key=lambda e: e.total)


@pytest.mark.parametrize("stage, params, grads, optim", [
    (0, 4 * PSI, 4 * PSI, 8 * PSI),
    (1, 4 * PSI, 4 * PSI, 8 * PSI / 4),
    (2, 4 * PSI, 4 * PSI / 4, 8 * PSI / 4),
    (3, 4 * PSI / 4, 4 * PSI / 4, 8 * PSI / 4),
])
def test_model_state_per_zero_stage(stage, params, grads, optim):
    """The state at rest is the optimizer step's (every gradient there). At the forward peak of
    one microbatch the gradients are there only where they outlive the step (ZeRO-1's buffer,
    ZeRO-2's slice); zero_grad freed the others, and the first backward starts with the head's
    (20,480 parameters: vocab 320 x dim 64), sharded at ZeRO-3."""
    over = {"parallel.dp_shard": "4", "parallel.zero_stage": str(stage)} if stage else {}
    cfg = config(4, **over)  # one microbatch
    rest = memory_instants(cfg)[-1]
    assert (rest.parameters, rest.gradients, rest.optimizer) == (params, grads, optim)
    assert rest.model_state == params + grads + optim
    peak = forward_peak(cfg)
    head = 320 * 64
    assert (peak.parameters, peak.optimizer) == (params, optim)
    assert peak.gradients == {0: 4 * head, 1: grads, 2: grads, 3: 4 * head / 4}[stage]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_over_dp_shard_times_cp(stage):
    """cp ranks hold the same weights, so ZeRO shards over dp_shard x cp: dp_shard 2 x cp 2 is
    dp_shard 4's model state (measured to the byte: docs/benchmarks.md, ZeRO compositions)."""
    over = {"parallel.zero_stage": str(stage)}
    # one microbatch in both (dp 2: global batch 4), so no gradients accumulate full-size
    with_cp = config(4, **over, **{"parallel.dp_shard": "2", "parallel.cp": "2",
                                   "parallel.cp_mode": "ring", "train.global_batch_size": "4"})
    shard4 = config(4, **over, **{"parallel.dp_shard": "4"})
    assert forward_peak(with_cp).model_state == forward_peak(shard4).model_state
    assert memory_instants(with_cp)[-1] == memory_instants(shard4)[-1]  # the optimizer step


def test_zero3_transient_is_two_gathered_blocks():
    one = config(2, **{"parallel.dp_shard": "2", "train.global_batch_size": "4"})  # 1 microbatch
    assert forward_peak(one).transient == 2 * 4 * 36_992


def test_layer_activations_match_the_measured_formula():
    # s=32, b=2, h=64, f=128, a=4, fp32: x = 4096; x*e*(8 + 4f/h) + 4sb(2 + a)
    assert layer_activation_bytes(config(1)) == 4096 * 4 * 16 + 4 * 64 * 6
    # TP=2: x*e*(4 + (4 + 4f/h)/t) + 4sb(2 + a/t)
    tp = config(2, **{"parallel.tp": "2", "model.n_kv_heads": "4"})
    assert layer_activation_bytes(tp) == 4096 * 4 * (4 + 12 / 2) + 4 * 64 * (2 + 2)
    # full recomputation keeps the block input only
    assert layer_activation_bytes(config(1), layer_recomputed=True) == 4096 * 4


def test_recomputation_shrinks_activations_in_order():
    acts = {p: forward_peak(config(1, **{"train.recompute": p})).activations
            for p in ("none", "selective", "every_k", "full")}
    assert acts["none"] > acts["selective"] > acts["every_k"] > acts["full"]


def test_pipeline_in_flight_microbatches():
    # 1F1B, pp=2, 4 microbatches: rank 0 holds 2 in flight of its 2 layers + embedding
    est = estimate_memory(config(2, **{"parallel.pp": "2", "train.global_batch_size": "8"}))
    assert est.rank in (0, 1)
    assert est.activations >= 2 * 2 * layer_activation_bytes(config(1))


def test_refusal_names_estimate_and_largest_component():
    tight = config(1, **{"train.memory_limit_gb": "0.0001"})
    message = check_memory_limit(tight)
    assert "exceeds the limit" in message and "largest component: optimizer" in message
    assert check_memory_limit(config(1, **{"train.memory_limit_gb": "0.0001",
                                           "train.ignore_memory_limit": "true"})) is None
    assert check_memory_limit(config(1)) is None  # CPU: fits the host's available memory


def test_on_cpu_the_local_ranks_share_the_hosts_available_memory(monkeypatch):
    """No train.memory_limit_gb on a CPU device: 90% of MemAvailable over the local ranks."""
    from loom.train import memory

    cpu = config(1, **{"train.device": "cpu"})
    peak = estimate_memory(cpu).total
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 3.03 * peak / 0.9)
    assert memory.device_limit_bytes(cpu, 2) == pytest.approx(1.515 * peak)
    assert check_memory_limit(cpu, 3) is None  # 3 x the peak fits, 4 x does not
    message = check_memory_limit(cpu, 4)
    assert message.startswith("config error: train.skip_memory_check=False: estimated peak")
    assert "shared by 4 local rank(s)" in message and "--train.skip_memory_check=true" in message
    for flag in ("train.skip_memory_check", "train.ignore_memory_limit"):
        assert check_memory_limit(config(1, **{"train.device": "cpu", flag: "true"}), 4) is None
    # an explicit limit is per rank, whatever the host has
    explicit = config(1, **{"train.device": "cpu", "train.memory_limit_gb": str(2 * peak / 2**30)})
    assert check_memory_limit(explicit, 4) is None


def test_host_available_bytes_reads_meminfo():
    from loom.train.memory import host_available_bytes

    with open("/proc/meminfo") as meminfo:
        kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    assert host_available_bytes() == pytest.approx(kib * 1024, rel=0.5)


def test_loom_train_refuses_before_launch(capsys, tmp_path):
    code = main(["train", "--model.preset=debug", "--train.memory_limit_gb=0.0001",
                 f"--train.run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "estimated peak memory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_estimate_memory_command(capsys):
    assert main(["estimate-memory", "--nproc", "4", "--parallel.dp_shard=4",
                 "--model.preset=debug"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "total" in out


# -- what the peak holds beyond the at-rest model state -------------------------------------------
LAYER_ACT = 4096 * 4 * 16 + 4 * 64 * 6  # one debug block, s=32, b=2, fp32: 263,680
# the head: norm in/out, rstd, the fp32 log-probabilities (not the logits: none keeps them)
HEAD_ACT = 2 * 64 * 64 * 4 + 4 * 64 + 4 * 64 * 320
BLOCK = 36_992
RANK0 = 2 * BLOCK + 20_480  # pp2, 1F1B: two blocks and the embedding (94,464)
NORMS = 9 * 64  # the no-decay parameters (a bucket of their own)


def accumulating(stage: int, **over):
    """dp_shard 4 and 4 microbatches of 2 (global batch 32)."""
    return config(4, **{"parallel.dp_shard": "4", "parallel.zero_stage": str(stage),
                        "train.global_batch_size": "32", **over})


def test_zero2_accumulation_holds_full_gradients_and_the_persistent_slice():
    """Hooks off for the first 3 microbatches: autograd accumulates full-size p.grad (4 Psi)
    beside the bucket's persistent reduced slice (4 Psi / 4) at the last microbatch's forward."""
    est = forward_peak(accumulating(2))
    assert (est.parameters, est.gradients, est.optimizer, est.transient) == \
        (4 * PSI, 4 * PSI + PSI, 2 * PSI, 0)
    assert est.activations == 4 * LAYER_ACT + HEAD_ACT  # one microbatch in flight
    assert any("full-size" in note for note in est.notes)
    assert forward_peak(accumulating(2, **{"train.global_batch_size": "8"})).gradients == PSI


def _reduction(cfg):
    return [e for e in memory_instants(cfg) if any("ZeRO-2 reduction" in n for n in e.notes)]


@pytest.mark.parametrize("batch", ["8", "32"])  # 1 and 4 microbatches
def test_zero2_reduction_packs_the_gradients_into_bucket_buffers(batch):
    """During the last backward the hooks pack each gradient into its bucket's buffer and free
    it. The debug model fits one 25 MB bucket per weight-decay group. At the backward's start
    the first buffer is beside every activation; without accumulation, once the head and the
    top block are done, all buffers and the slices' outputs. With 4 microbatches autograd's
    accumulated full-size gradients are held beside the first buffer (freed as packed)."""
    cfg = accumulating(2, **{"train.global_batch_size": batch})
    start, *later = _reduction(cfg)
    full = 4 * PSI if batch == "32" else 0
    assert (start.parameters, start.gradients, start.optimizer, start.activations,
            start.transient) == (4 * PSI, PSI + full, 2 * PSI, 4 * LAYER_ACT + HEAD_ACT, 4 * PSI)
    if batch == "32":
        assert later == []
    else:
        (done,) = later
        assert (done.gradients, done.activations, done.transient) == \
            (PSI, 3 * LAYER_ACT, 4 * PSI + PSI)  # buffers and outputs
    assert estimate_memory(cfg) == start  # the debug model's peak


@pytest.mark.parametrize("batch, every", [("8", False), ("32", False), ("32", True)])
def test_zero2_small_buckets_bound_the_packed_gradients(batch, every):
    """With 10 KiB buckets the buffers are bounded by buckets, not by the model: three (two
    reduce-scatters in flight, one being packed), or one beside the accumulated full-size
    gradients; a bucket closes at most one parameter (the 320 x 64 embedding) past its size.
    Reducing every microbatch never accumulates full-size gradients."""
    cfg = accumulating(2, **{"train.global_batch_size": batch, "train.grad_bucket_mb": str(10 / 1024),
                             "train.grad_reduce_every_microbatch": str(every).lower()})
    bucket = 10 * 2**10 + 4 * 320 * 64
    accumulated = batch == "32" and not every
    start, *later = _reduction(cfg)
    assert start.transient == bucket
    assert start.gradients == PSI + (4 * PSI if accumulated else 0)
    assert [e.transient for e in later] == ([] if accumulated else [3 * bucket + PSI])
    if every:
        assert all(e.gradients == PSI for e in memory_instants(cfg)[:-1])  # never full-size


def test_fused_optimizer_step_adds_no_temporaries():
    """No activations, and nothing beside the state: Loom's AdamW is fused on the CPU and CUDA
    (one elementwise kernel) for every layout whose parameters are all plain or all DTensors."""
    for stage in (0, 1, 3):
        cfg = accumulating(stage) if stage else config(1)
        step = memory_instants(cfg)[-1]
        assert (step.activations, step.transient) == (0, 0)
        first = memory_instants(cfg)[0]  # the first forward: the state at rest, but zero_grad
        # has freed the gradients that do not outlive the step (all but ZeRO-1/2's)
        assert (step.parameters, step.optimizer) == (first.parameters, first.optimizer)
        assert first.gradients == (step.gradients if stage in (1, 2) else 0)


@pytest.mark.parametrize("over, fused", [
    ({}, False),  # the norms and the ends stay plain beside DTensor linears
    ({"parallel.sequence_parallel": "true"}, True),  # all DTensors
    ({"parallel.sequence_parallel": "true", "parallel.vocab_parallel": "false"}, False),
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "1"}, True),  # plain flat slices
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "3"}, True),  # FSDP2: all DTensors
])
def test_unfused_step_adds_two_temporaries_of_the_stepped_state(over, fused):
    """The rule (``adamw_step_fused``, ``zero.adamw_kernel``'s): a list mixing DTensors and
    plain tensors -- tp > 1 without ZeRO, unless sequence and vocabulary parallelism make every
    parameter a DTensor -- steps with foreach AdamW, whose square root of the second moment and
    quotient are the size of the fp32 state it steps: 2 x 4 Ψ/d, the moments' bytes at fp32."""
    world = 4 if "parallel.dp_shard" in over else 2
    cfg = config(world, **{"parallel.tp": "2", "train.global_batch_size": str(2 * world),
                           **over})
    step = memory_instants(cfg)[-1]
    assert step.activations == 0
    assert step.transient == (0 if fused else step.optimizer)
    assert step.optimizer > 0


def test_fused_step_rule_by_device_and_layout():
    """``adamw_step_fused``: torch's fused kernel exists for these device types (not for meta);
    only tp > 1 without ZeRO can mix DTensors and plain tensors in one list."""
    assert set(FUSED_ADAMW_DEVICES) <= set(_get_fused_kernels_supported_devices())
    tp2 = dict(tp=2, zero_stage=0, sequence_parallel=True, vocab_parallel=True)
    assert adamw_step_fused("cuda:3", **tp2) and adamw_step_fused("auto", **tp2)
    assert not adamw_step_fused("meta", **{**tp2, "tp": 1})
    assert not adamw_step_fused("cpu", **tp2, moe=True)  # the router stays plain
    assert adamw_step_fused("cpu", **{**tp2, "vocab_parallel": False}, ends=False)  # mid stage
    assert not adamw_step_fused("cpu", **{**tp2, "vocab_parallel": False})
    assert adamw_step_fused("cpu", **{**tp2, "sequence_parallel": False, "zero_stage": 2})


def test_zero3_accumulation_holds_unsharded_gradients_instead_of_shards():
    """FSDP2 with gradient sync off keeps each unit's unsharded gradient; the shards exist only
    after the last microbatch's reduce-scatter (zero_grad frees them at step start). A unit's
    fresh gradient sits beside its accumulated one until added: one more block."""
    est = forward_peak(accumulating(3))
    assert (est.parameters, est.gradients, est.optimizer, est.transient) == \
        (PSI, 4 * PSI, 2 * PSI, 2 * 4 * BLOCK + 4 * BLOCK)
    # bf16 compute and bf16 reduction: FSDP2 accumulates in the compute dtype
    bf16 = forward_peak(accumulating(3, **{"train.dtype": "bf16",
                                           "train.grad_reduce_dtype": "bf16"}))
    assert bf16.gradients == 2 * PSI
    assert forward_peak(accumulating(3, **{"train.dtype": "bf16"})).gradients == 4 * PSI


def test_zero1_gradient_buffer_is_full_size_with_or_without_accumulation():
    est = forward_peak(accumulating(1))
    assert est.gradients == 4 * PSI and not est.notes


def test_zero3_held_pipeline_stages_are_whole_with_full_gradients():
    """pp2 x dp_shard2, 1F1B, 4 microbatches, reshard_after_forward = false: rank 0's stage is
    gathered from its first F to its flush, and at its third F (2 in flight, after B0) its
    gradients are full-size."""
    over = {"parallel.pp": "2", "parallel.dp_shard": "2", "parallel.zero_stage": "3",
            "train.global_batch_size": "16"}
    held_cfg = config(4, **over, **{"parallel.reshard_after_forward": "false"})
    held = forward_peak(held_cfg)
    assert (held.parameters, held.gradients, held.optimizer, held.activations, held.transient) \
        == (4 * RANK0 / 2 + 4 * RANK0, 4 * RANK0, 8 * RANK0 / 2, 2 * 2 * LAYER_ACT, 4 * BLOCK)
    assert any("held gathered" in note for note in held.notes)
    assert estimate_memory(held_cfg) == held
    # gathered from the first F; resharded at the flush, before the optimizer step
    rank0 = [e for e in memory_instants(held_cfg) if e.rank == 0]
    assert rank0[0].parameters == 4 * RANK0 / 2 + 4 * RANK0  # during the first F
    assert rank0[-1].parameters == 4 * RANK0 / 2
    # gathered per microbatch instead: the two in-use blocks, full-size gradients all the same
    per_mb = forward_peak(config(4, **over))
    assert (per_mb.parameters, per_mb.gradients, per_mb.transient) == \
        (4 * RANK0 / 2, 4 * RANK0, 2 * 4 * BLOCK + 4 * BLOCK)
    assert not any("held gathered" in note for note in per_mb.notes)


def test_zero3_held_v_schedule_holds_both_stages_of_a_rank():
    """ZB-V (I and W split: held is required) places stages 0 and 3 on rank 0; both are whole
    and accumulate full-size gradients at the peak."""
    est = forward_peak(config(4, **{"parallel.pp": "2", "parallel.dp_shard": "2",
                                    "parallel.zero_stage": "3", "parallel.schedule": "zbv",
                                    "parallel.reshard_after_forward": "false",
                                    "train.global_batch_size": "16"}))
    rank0 = 2 * BLOCK + 20_480 + 20_480 + 64  # layers 0 and 3, both ends
    assert (est.parameters, est.gradients) == (4 * rank0 / 2 + 4 * rank0, 4 * rank0)


def test_refusal_counts_the_new_terms_and_names_the_largest():
    """A limit the at-rest estimate fits but the ZeRO-2 peak does not is refused, naming the
    largest component and the notes, and the flag overrides it."""
    base = {"parallel.dp_shard": "4", "parallel.zero_stage": "2", "train.global_batch_size": "32"}
    est = estimate_memory(config(4, **base))
    at_rest = 4 * PSI + PSI + 2 * PSI + 4 * LAYER_ACT + HEAD_ACT  # what the old estimate said
    assert at_rest < est.total
    tight = {**base, "train.memory_limit_gb": str((at_rest + est.total) / 2 / 2**30)}
    message = check_memory_limit(config(4, **tight))
    assert message is not None and f"largest component: {est.largest()[0]}" in message
    assert "ZeRO-2 reduction" in message
    assert check_memory_limit(config(4, **tight, **{"train.ignore_memory_limit": "true"})) is None
    # the held ZeRO-3 pipeline stage: refused, the note names the whole parameters
    over = {"parallel.pp": "2", "parallel.dp_shard": "2", "parallel.zero_stage": "3",
            "parallel.reshard_after_forward": "false", "train.global_batch_size": "16"}
    peak = estimate_memory(config(4, **over))
    limit = str((peak.total - 1000) / 2**30)
    message = check_memory_limit(config(4, **over, **{"train.memory_limit_gb": limit}))
    assert message is not None and "held gathered" in message
    assert f"largest component: {peak.largest()[0]}" in message


def test_model_state_bytes_accumulating_keyword():
    """The planner's pure function: unchanged by default, the accumulation peak on request."""
    from loom.train.memory import model_state_bytes

    assert model_state_bytes(800, 4, 2) == (3200, 800, 1600)
    assert model_state_bytes(800, 4, 2, accumulating=True) == (3200, 800 + 3200, 1600)
    assert model_state_bytes(800, 4, 3, accumulating=True) == (800, 3200, 1600)
    assert model_state_bytes(800, 4, 3, accumulating=True, grad_bytes=2) == (800, 1600, 1600)
    for stage in (0, 1):
        assert model_state_bytes(800, 4, stage, accumulating=True) == \
            model_state_bytes(800, 4, stage)


def test_pure_instant_functions_for_the_planner():
    from loom.train.memory import optimizer_step_bytes, zero2_reduction_bytes

    assert zero2_reduction_bytes(800, 4, accumulated=True) == (3200, 3200 + 800)
    assert zero2_reduction_bytes(800, 4, accumulated=False) == (0, 3200 + 800)
    big = 100 * 2**20  # elements: past three 25 MB buckets, so bounded by buckets, not the model
    assert zero2_reduction_bytes(big, 4, accumulated=False) == (0, 3 * 25 * 2**20 + big)
    assert zero2_reduction_bytes(big, 4, accumulated=True, largest=100) == \
        (4 * big, 25 * 2**20 + 100 + big)
    assert optimizer_step_bytes(800, 4, 0) == 6400 and optimizer_step_bytes(800, 4, 2) == 1600


def test_bidirectional_pipeline_counts_both_copies_of_the_model():
    """bidirectional_v at p = 2 holds two copies of a 4-stage V: each rank holds two model stages
    of one copy and the other two of the other copy (with the estimator splitting the layers per
    copy, not over all 8 stages), so its model state is exactly one process's."""
    bidi = config(2, **{"parallel.pp": "2", "parallel.schedule": "bidirectional_v"})
    est = max(memory_instants(bidi), key=lambda e: e.optimizer)
    assert est.optimizer == pytest.approx(8 * PSI)
    assert est.parameters == pytest.approx(4 * PSI)


@pytest.mark.parametrize("stage, measured", [(1, 2_413_696), (2, 1_807_552), (3, 1_201_408)])
def test_zero_with_expert_parallelism_matches_the_measured_model_state(stage, measured):
    """tiny-moe on dp_shard2 x ep2: dense weights shard over dp_shard x ep (4 ranks), each ep
    rank's experts over dp_shard (2); the model state at rest equals the bytes measured in
    docs/benchmarks.md ("ZeRO with expert parallelism"): Ψ_d = 152,896 dense, Ψ_e = 147,456
    expert elements, Ψ_e/2 on each ep rank."""
    cfg = config(4, **{"model.preset": "tiny-moe", "parallel.dp_shard": "2", "parallel.ep": "2",
                       "parallel.dp_replicate": "1", "parallel.zero_stage": str(stage),
                       "train.global_batch_size": "8", "train.micro_batch_size": "2"})
    at_rest = [e for e in memory_instants(cfg) if e.rank == 0][-1]  # the optimizer step
    assert at_rest.parameters + at_rest.gradients + at_rest.optimizer == measured
