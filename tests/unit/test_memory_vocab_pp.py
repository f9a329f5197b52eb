"""The memory estimator under vocabulary parallelism across the pipeline
(``parallel.vocab_parallel_pp``): every pipeline rank holds V/(pp x tp) rows of the embedding
and of the head with their state, the last stage no longer the whole head, and each microbatch's
exp-logits between its S and T. Expected bytes are written out by formula (activations to a
float's rounding: the estimator scales them through one microbatch's units)."""

from __future__ import annotations

from pytest import approx

from loom.config import load_config, resolve
from loom.train.memory import layer_activation_bytes, memory_instants

# debug preset (untied, vocab 320, dim 64, 4 layers): one layer 36,992 parameters (see
# test_memory_estimate.py); pp 4 puts one layer on each rank
LAYER, V, D = 36_992, 320, 64
SMALL = {"model.preset": "debug", "data.seq_len": "32", "train.micro_batch_size": "2",
         "train.global_batch_size": "8", "parallel.pp": "4"}
N = 2 * 32  # tokens per microbatch
M = 4  # microbatches: 8 sequences / 2 per microbatch


def config(vocab_pp: bool, **overrides):
    return resolve(load_config(None, {**SMALL, "parallel.vocab_parallel_pp": str(vocab_pp),
                                      **overrides}), 4)


def rank_instants(cfg, rank: int):
    return [e for e in memory_instants(cfg) if e.rank == rank]


def test_every_rank_holds_its_rows_and_the_last_no_whole_head():
    """At the optimizer step (every gradient there): Ψ_r = one layer + V/4 rows of the
    embedding and of the head (80 x 64 each), the last rank also the final norm; fp32 state
    is 4Ψ + 4Ψ + 8Ψ. Without vocab-pp the first rank holds the whole embedding and the last the
    whole head (320 x 64)."""
    rows = V // 4 * D
    for rank in range(4):
        psi = LAYER + 2 * rows + (D if rank == 3 else 0)
        rest = rank_instants(config(True), rank)[-1]
        assert (rest.parameters, rest.gradients, rest.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    whole = rank_instants(config(False), 3)[-1]
    assert whole.parameters == 4 * (LAYER + V * D + D)
    assert rank_instants(config(True), 3)[-1].parameters == \
        whole.parameters - 4 * (V * D - 2 * rows)


def test_bf16_rows_keep_fp32_masters():
    """train.dtype = bf16: 2-byte rows, fp32 masters and moments (12 bytes), as the stages'."""
    rows = V // 4 * D
    psi = LAYER + 2 * rows
    rest = rank_instants(config(True, **{"train.dtype": "bf16"}), 0)[-1]
    assert (rest.parameters, rest.optimizer) == (2 * psi, 12 * psi)


def test_exp_logits_between_s_and_t():
    """The last rank runs F3.0 S3.0 F3.1 S3.1 T3.0 B3.0 F3.2 S3.2 T3.1 ... (vocab 1F1B): during
    T3.0 two microbatches are in flight in its stage (one layer and the final norm's input,
    output and rstd) and two hold their exp-logits [N, V/4] fp32 (its X is its own output);
    every rank holds its M partial embeddings and as many [N, D] buffers all step (fp32).
    During T3.1 the head rows' fresh gradient (80 x 64 fp32) adds to that."""
    cfg = config(True)
    norm = 2 * N * D * 4 + 4 * N
    per_micro = layer_activation_bytes(cfg) + norm
    held = M * N * D * (4 + 4)
    exp_logits = 4 * N * (V // 4)
    instants = rank_instants(cfg, 3)  # during and after each action, then the optimizer step
    t0, t1 = instants[2 * 4], instants[2 * 8]
    assert t0.activations == approx(2 * per_micro + held + 2 * exp_logits)
    assert t1.activations == approx(2 * per_micro + held + 2 * exp_logits + 4 * (V // 4) * D)


def test_the_last_rank_drops_the_head_at_a_large_vocabulary():
    """Vocabulary 8192: without vocab-pp the last rank's model state carries the whole head
    (8192 x 64) and its peak the head's logits and log-softmax [N, V] (fp32) per microbatch in
    flight; with it, a quarter of the rows and two windows of [N, V/4] exp-logits."""
    big = {"model.vocab_size": "8192"}
    split, whole = (rank_instants(config(flag, **big), 3) for flag in (True, False))
    assert split[-1].parameters == whole[-1].parameters - 4 * (8192 * D - 2 * 8192 // 4 * D)
    assert max(e.total for e in split) < max(e.total for e in whole)
    assert max(e.activations for e in split) < max(e.activations for e in whole)


def test_other_ranks_keep_the_received_x():
    """Rank 0 runs F0.0 .. F0.3 S0.0 S0.1 T0.0: during T0.0 its one layer holds four
    microbatches, and two exp-logits with their received X ([N, D] fp32) are held."""
    cfg = config(True)
    instants = rank_instants(cfg, 0)
    pass_bytes = 4 * N * (V // 4) + 4 * N * D
    assert instants[2 * 6].activations == approx(4 * layer_activation_bytes(cfg)
                                                 + M * N * D * 8 + 2 * pass_bytes)


# ZeRO on dp_shard (vocab_pipeline.data_parallel_rows): pp 2 x dp_shard 2, two layers a rank
# and V/2 = 160 rows of the embedding and of the head, m = 2 (8 sequences / (2 x 2))
ROWS2 = V // 2 * D


def zero_config(stage: int, **overrides):
    return resolve(load_config(None, {**SMALL, "parallel.pp": "2", "parallel.dp_shard": "2",
                                      "parallel.zero_stage": str(stage),
                                      "parallel.vocab_parallel_pp": "true", **overrides}), 4)


def test_zero3_holds_the_rows_gathered_all_step_and_their_gradients_unsharded():
    """ZeRO-3 (GatheredRows): the rows are all-gathered at the step's start and held until the
    reduce-scatter after the embedding's backward, whatever reshard_after_forward says (here
    true: the stage's blocks are gathered per use, not held). Rank 0 runs F F S S T T B B:
    from the first instant its parameters are the shards 4Ψ/2 plus both rows whole (fp32),
    after its first T the head rows' unsharded gradient (fp32) is the only gradient, and after
    the last action the rows are resharded."""
    psi = 2 * LAYER + 2 * ROWS2
    instants = rank_instants(zero_config(3), 0)
    assert instants[0].parameters == 4 * psi / 2 + 4 * 2 * ROWS2
    assert instants[2 * 4 + 1].gradients == 4 * ROWS2  # right after T0.0
    assert instants[2 * 7].parameters == 4 * psi / 2 + 4 * 2 * ROWS2  # during the last B
    assert instants[2 * 7 + 1].parameters == 4 * psi / 2  # after it: resharded
    # bf16: the rows gathered in the compute dtype, the shards fp32 (FSDP2's masters)
    bf16 = rank_instants(zero_config(3, **{"train.dtype": "bf16"}), 0)
    assert bf16[0].parameters == 4 * psi / 2 + 2 * 2 * ROWS2


def test_zero3_rows_are_counted_once_when_the_stages_are_held():
    """reshard_after_forward = false holds the stage from its first F as well: the rows are
    gathered once, not twice."""
    psi = 2 * LAYER + 2 * ROWS2
    held = rank_instants(zero_config(3, **{"parallel.reshard_after_forward": "false"}), 0)
    assert held[0].parameters == 4 * psi / 2 + 4 * psi


def test_zero1_keeps_the_rows_whole_and_slices_their_optimizer_state():
    """ZeRO-1: the rows and their gradients whole, AdamW's moments sliced over dp_shard with
    the stages' (8Ψ/2), at the optimizer step."""
    psi = 2 * LAYER + 2 * ROWS2
    rest = rank_instants(zero_config(1), 0)[-1]
    assert (rest.parameters, rest.gradients, rest.optimizer) == (4 * psi, 4 * psi, 8 * psi / 2)
