"""Vocabulary parallelism across the pipeline in bf16: one bf16 process, split over the vocabulary.

``train.dtype = bf16`` makes every shard's rows bf16 parameters with fp32 masters (as the stages'
parameters: ``loom.parallel.mixed_precision``), so the head's matmul, its backward and the
embedding lookup run in bf16 as one process's do; ``bf16_autocast`` keeps them fp32 and runs the
shard's matmul under the stages' autocast. Either way the logits are upcast to fp32 before their
softmax statistics, which travel and combine in fp32, and the p parts of dX are added in fp32.

Against one bf16 (or autocast) process with the same global batch, each pipeline microbatch the
size of one of its microbatches (1F1B; fp32 and bf16 gradient accumulation; tied on ZB-V, the V
variant; autocast; pp 2 x dp_replicate 2), ``tests/dist/test_bf16_master.py``'s tolerances and
reasons:

* the first step's loss: fp32 parity's first-step bound (rtol 1e-5, atol 1e-6). Each logit is
  the same bf16 dot product over D as one process's (a shard computes a subset of the columns),
  and the loss from them is fp32 arithmetic in another order (measured: 1.6e-7 relative);
* the first step's gradients and gradient norm: bf16's bound for a layout that computes in
  another order (rtol 2e-2, atol 1e-4), as tp's and a tied pipeline's: dX is the sum of p bf16
  partial products (each rounded by its matmul, their fp32 sum once more) where one process
  rounds one matmul over all of V, and the softmax - onehot comes from the combined statistics
  rather than one ``F.cross_entropy``, so elements land a bf16 rounding or two (2^-8) apart and
  carry that through the backward (measured: at most 7.7e-3 of a weight's largest gradient
  element, 6.5e-3 under autocast). Later steps inherit it through Adam, as in those layouts.

Then the checkpoint: a bf16 vocab-pp run saves its fp32 masters, rows at their offsets, and one
fp32 process loads exactly that state (weights fp32, bit-identical, with the moments).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES
from tests.dist.test_bf16_master import _assert_same_state, load_state, save_state

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": STEPS,
        "train.global_batch_size": 4, "train.micro_batch_size": 2, "optim.warmup_steps": 0,
        "optim.min_lr_ratio": 1.0, "optim.lr": 3e-3, "train.grad_clip": 0.05}
VOCAB = {"parallel.vocab_parallel_pp": True}
RTOL_LOSS, ATOL_LOSS = 1e-5, 1e-6
RTOL_BF16, ATOL_BF16 = 2e-2, 1e-4
CASES = {  # name -> (config overrides, parallel degrees)
    "bf16-1f1b": ({"train.dtype": "bf16"}, {"pp": 2, "schedule": "1f1b"}),
    "bf16-bf16-grads": ({"train.dtype": "bf16", "train.grad_reduce_dtype": "bf16"},
                        {"pp": 2, "schedule": "1f1b"}),
    "bf16-zbv-tied": ({"train.dtype": "bf16", "model.tie_embeddings": True},
                      {"pp": 2, "schedule": "zbv"}),
    "bf16_autocast-1f1b": ({"train.dtype": "bf16_autocast"}, {"pp": 2, "schedule": "1f1b"}),
    # the rows' fp32 main_grads averaged over dp by their own reducer
    "bf16-dp2": ({"train.dtype": "bf16", "train.global_batch_size": 8},
                 {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}),
}


@pytest.fixture(scope="module")
def references(dist, small_data_dir):
    """One process per (dtype, gradient dtype, tied), computed on first use."""
    cache: dict = {}

    def get(overrides: dict) -> dict:
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            cache[key] = dist.run(1, record_training, layout_config({**BASE, **overrides}, 1),
                                  small_data_dir, STEPS)[0]
        return cache[key]

    return get


def first_step(record: dict) -> dict:
    return {key: value[:1] for key, value in record.items()}


def assert_bf16_first_step(reference: dict, result: dict, label: str) -> None:
    """The first loss to fp32 parity's first-step bound, the first step's gradients to bf16's
    bound for a layout that computes in another order (the module docstring)."""
    torch.testing.assert_close(torch.tensor(result["loss"][0]),
                               torch.tensor(reference["loss"][0]), rtol=RTOL_LOSS,
                               atol=ATOL_LOSS, msg=lambda m: f"{label} first loss: {m}")
    assert_parity(first_step(reference), first_step(result), rtol=RTOL_BF16, atol=ATOL_BF16,
                  label=label)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_vocab_parallel_pipeline_matches_one_bf16_process(dist, small_data_dir, references,
                                                               name):
    overrides, degrees = CASES[name]
    world = degrees["pp"] * degrees.get("dp_replicate", 1)
    table = layout_config({**BASE, **VOCAB, **overrides}, world, **degrees)
    reference = references(overrides)
    for rank, result in enumerate(dist.run(world, record_training, table, small_data_dir,
                                           STEPS)):
        assert_bf16_first_step(reference, result, f"vocab-pp {name} rank {rank}")
    assert len(set(reference["loss"])) == STEPS  # it trained


@pytest.mark.parametrize("mode", ["bf16", "bf16_autocast", "fp32"])
@pytest.mark.parametrize("shards", [2, 4])
def test_each_shard_computes_one_process_logits_bit_for_bit(mode, shards):
    """Below the tolerances above, what makes the head right in every dtype: each shard's logits
    are the very values of the whole output layer's in the same mode (bf16 rows and a bf16 X;
    fp32 rows under autocast; fp32), upcast to fp32, so its row max and target logit are exactly
    those of its columns of one process's logits, and the loss combined from the p shards'
    fp32 statistics is ``F.cross_entropy`` of the full logits up to fp32 summation order
    (on the CPU, where a column subset of a matmul is the same dot products)."""
    import torch.nn.functional as F

    from loom.models.llama import initial_value, seeded_name
    from loom.models.presets import PRESETS
    from loom.parallel.mixed_precision import apply_bf16_parameters
    from loom.parallel.vocab_pipeline import VocabShard, cross_entropy

    args, seed = PRESETS["debug"], 0
    vocab, dim = args.vocab_size, args.dim
    weight = initial_value(seeded_name("output.weight", args), torch.Size((vocab, dim)), args,
                           seed)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, dim, generator=generator)
    targets = torch.randint(0, vocab, (2, 8), generator=generator)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    if mode == "bf16":
        x, weight = x.bfloat16(), weight.bfloat16()
    with autocast() if mode == "bf16_autocast" else contextlib.nullcontext():
        full = F.linear(x, weight)
    full = full.flatten(0, 1).float()
    stats, passes = [], []
    for rank in range(shards):
        shard = VocabShard(args, rank, shards, "cpu", seed,
                           **({"autocast": autocast} if mode == "bf16_autocast" else {}))
        if mode == "bf16":
            apply_bf16_parameters(shard, torch.float32)
        state, shard_stats = shard.s_pass(x, targets)
        columns = full[:, rank * vocab // shards:(rank + 1) * vocab // shards]
        assert torch.equal(shard_stats[0], columns.max(dim=-1).values)
        assert torch.equal(state.exp, (columns - shard_stats[0][:, None]).exp())
        stats.append(shard_stats)
        passes.append((shard, state))
    losses = [shard.t_pass(state, stats, targets, cross_entropy, training=False)[0]
              for shard, state in passes]
    expected = F.cross_entropy(full, targets.flatten())
    for loss in losses:
        assert torch.equal(loss, losses[0])  # every shard, the same bits
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def shard_dtypes(ctx, config_table, data_dir):
    """After one step: the dtypes of this rank's vocabulary rows, their masters and moments."""
    from loom.config import from_dict
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.train_step()
    rows = list(trainer.pipeline.vocab.parameters())
    return ({str(p.dtype) for p in rows}, {str(p.master_weight.dtype) for p in rows},
            {str(trainer.optimizer.state[p]["exp_avg"].dtype) for p in rows})


def test_bf16_rows_keep_fp32_masters_and_moments(dist, small_data_dir):
    table = layout_config({**BASE, **VOCAB, "train.dtype": "bf16"}, 2, pp=2)
    for params, masters, moments in dist.run(2, shard_dtypes, table, small_data_dir):
        assert params == {"torch.bfloat16"}
        assert masters == moments == {"torch.float32"}


def test_a_bf16_vocab_parallel_checkpoint_loads_into_one_fp32_process(dist, small_data_dir,
                                                                      tmp_path):
    ckpt = {**BASE, "train.eval_every": 0}
    bf16_vocab = layout_config({**ckpt, **VOCAB, "train.dtype": "bf16"}, 2, pp=2)
    path, saved = dist.run(2, save_state, bf16_vocab, small_data_dir, str(tmp_path / "a"))[0]
    assert {v.dtype for k, v in saved.items() if k.startswith("model/")} == {torch.float32}
    state, _, _ = dist.run(1, load_state, layout_config(ckpt, 1), small_data_dir, path, None)[0]
    _assert_same_state(saved, state)
