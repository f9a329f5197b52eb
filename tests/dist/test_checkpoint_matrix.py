"""The reshard matrix: a checkpoint saved under each 4-rank layout loads under every other one with
bit-identical weights and optimizer state, and the next training step gives the source layout's
next loss.

One save per layout (each also records the loss of the step after the save), then one task per
target layout that loads every other layout's checkpoint in turn into the same Trainer, gathers
the full state and trains one step. All on one 4-rank pool, with the tiny debug model.

Tolerance of the next loss: the weights, optimizer state, data position and batch are identical
(checked bit for bit first), so the loss of the next step differs between layouts only by the
order of the floating-point reductions (data-parallel mean, tensor-parallel and ring-attention
partial sums); that is the situation of step 1 of every parity test: rtol 1e-5, atol 1e-6 (see
tests/dist/test_data_parallel.py). The state itself is compared exactly (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

from loom.config import from_dict
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES, matrix
from tests.dist.test_checkpoint_resume import assert_equal_states

WORLD = 4
SAVE_AT = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 6,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0}
RTOL, ATOL = 1e-5, 1e-6

LAYOUTS = {  # name -> parallel degrees and schedule, all on 4 ranks
    "dp4": {"dp_replicate": 4},
    "zero1-dp4": {"dp_shard": 4, "zero_stage": 1},
    "hsdp-2x2": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3},
    "tp2-sp-dp2": {"tp": 2, "sequence_parallel": True, "dp_replicate": 2},
    "pp2-interleaved-dp2": {"pp": 2, "dp_replicate": 2, "schedule": "interleaved_1f1b",
                            "chunks": 2},
    "cp2-ring-dp2": {"cp": 2, "cp_mode": "ring", "dp_replicate": 2},
}


def _config(layout: str) -> dict:
    return layout_config(BASE, WORLD, **LAYOUTS[layout])


def save_and_step(ctx, config_table, data_dir, root):
    """Train SAVE_AT steps, save, gather the saved state, then train one more step."""
    from loom.train.checkpointing import checkpoint_tensors
    from loom.train.checkpoint_state import gather_full
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(SAVE_AT):
        trainer.train_step()
    path = trainer.save_checkpoint(root)
    state = gather_full(checkpoint_tensors(trainer))
    next_loss = trainer.train_step()["loss"]
    return (str(path), state, next_loss) if ctx.rank == 0 else None


def load_each_and_step(ctx, config_table, data_dir, paths):
    """One Trainer of the target layout loads each checkpoint in turn: its step, full state and
    the loss of the step after the load."""
    from loom.train.checkpointing import checkpoint_tensors
    from loom.train.checkpoint_state import gather_full
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    out = {}
    for source, path in paths.items():
        trainer.load_checkpoint(path)
        step = trainer.step
        state = gather_full(checkpoint_tensors(trainer))
        out[source] = (step, state, trainer.train_step()["loss"])
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def saved(dist, small_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    return {name: dist.run(WORLD, save_and_step, _config(name), small_data_dir,
                           str(root / name))[0] for name in LAYOUTS}


def test_the_sources_agree(saved):
    """Sanity of the matrix itself: every layout saved the same training state (weights and
    moments after two steps of the same run differ across layouts only by rounding), and the
    losses of the step after the save agree within the step-1 tolerance."""
    reference = saved["dp4"]
    for name, (_, state, next_loss) in saved.items():
        assert set(state) == set(reference[1]), name
        torch.testing.assert_close(torch.tensor(next_loss), torch.tensor(reference[2]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# CI loads every layout's checkpoint into the pipeline and the ring (the tp2 x SP checkpoint is
# among the sources; loads into tp run in test_zero_compose.py and test_checkpoint_async.py)
@pytest.mark.parametrize("target", matrix(LAYOUTS, ci=["pp2-interleaved-dp2", "cp2-ring-dp2"]))
def test_every_other_layout_loads_bit_identically_and_continues(dist, small_data_dir, saved,
                                                                target):
    paths = {source: saved[source][0] for source in LAYOUTS if source != target}
    loaded = dist.run(WORLD, load_each_and_step, _config(target), small_data_dir, paths)[0]
    assert set(loaded) == set(paths)
    for source, (step, state, next_loss) in loaded.items():
        label = f"{source} -> {target}"
        _, saved_state, saved_next_loss = saved[source]
        assert step == SAVE_AT, label
        assert_equal_states(state, saved_state, label)
        torch.testing.assert_close(torch.tensor(next_loss), torch.tensor(saved_next_loss),
                                   rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} next loss: {m}")
