"""The memory estimator's rule for a fused AdamW step is the trainer's: for each layout the
``Trainer`` builds, its optimizer is fused exactly where ``adamw_step_fused`` says (no
temporaries at the step; otherwise foreach's two, ``loom.train.memory``'s docstring)."""

from pathlib import Path

import pytest

from loom.config import from_dict, layout_of
from loom.formulas.memory import adamw_step_fused
from loom.testing.parity import layout_config
from loom.train.trainer import Trainer
from tests.conftest import SMALL_DATA_OVERRIDES

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_kv_heads": 4,
        "train.steps": 1, "train.global_batch_size": 8, "train.micro_batch_size": 2}
MOE = {**BASE, "model.preset": "tiny-moe"}

LAYOUTS = {  # name: (world, overrides, degrees, fused on every rank)
    "tp2": (2, BASE, {"tp": 2}, False),  # plain norms beside DTensor linears
    "tp2-sp": (2, BASE, {"tp": 2, "sequence_parallel": True}, True),  # all DTensors
    "tp2-sp-no-vocab-parallel": (2, BASE, {"tp": 2, "sequence_parallel": True,
                                           "vocab_parallel": False}, False),
    "tp2-zero1": (4, BASE, {"tp": 2, "dp_shard": 2, "zero_stage": 1}, True),  # flat slices
    "tp2-zero3": (4, BASE, {"tp": 2, "dp_shard": 2, "zero_stage": 3}, True),  # FSDP2
    "moe-tp2-sp": (2, MOE, {"tp": 2, "sequence_parallel": True}, False),  # plain router
    "pp2-tp2-sp-no-vocab-parallel": (4, {**BASE, "parallel.schedule": "1f1b"},
                                     {"pp": 2, "tp": 2, "sequence_parallel": True,
                                      "vocab_parallel": False}, False),
}


def fused_body(ctx, table: dict, data_dir: str) -> tuple[bool, bool]:
    config = from_dict(table)
    trainer = Trainer(config, Path(data_dir), None, ctx)
    lay = layout_of(config)
    holds_ends = any(getattr(s, "tok_embeddings", None) is not None
                     or getattr(s, "output", None) is not None
                     for s in trainer.model.modules())
    predicted = adamw_step_fused(
        config.train.device, tp=lay.tp, zero_stage=lay.zero_stage,
        sequence_parallel=lay.sequence_parallel, vocab_parallel=lay.vocab_parallel,
        moe=config.model.n_experts > 0, ends=holds_ends,
        vocab_parallel_pp=lay.vocab_parallel_pp)
    return bool(trainer.optimizer.defaults.get("fused")), predicted


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_optimizer_is_fused_where_the_estimator_says(dist, small_data_dir, layout):
    world, base, degrees, expected = LAYOUTS[layout]
    results = dist.run(world, fused_body, layout_config(base, world, **degrees), small_data_dir)
    for rank, (fused, predicted) in enumerate(results):
        assert fused == predicted == expected, \
            f"{layout} rank {rank}: fused={fused}, rule says {predicted}, expected {expected}"
