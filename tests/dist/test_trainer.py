"""Trainer behaviour beyond parity: resuming the data position, bf16 autocast (``bf16_autocast``)."""

import torch

from loom.testing.parity import layout_config
from loom.config import from_dict
from tests.conftest import SMALL_DATA_OVERRIDES

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 4,
        "train.global_batch_size": 4, "train.micro_batch_size": 2, "optim.warmup_steps": 1}


def train_then_peek(ctx, config_table, data_dir, steps):
    """Train ``steps`` steps; return the training state and this rank's *next* batch."""
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    for _ in range(steps):
        trainer.train_step()
    state = trainer.state_dict()
    return {"data": state["data"], "step": state["step"], "next": trainer.loader.next_batch()}


def resume_then_peek(ctx, config_table, data_dir, data_state):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.loader.load_state_dict(data_state)
    return trainer.loader.next_batch()


def test_training_state_holds_the_data_position_across_dp_degrees(dist, small_data_dir):
    at_dp2 = dist.run(2, train_then_peek, layout_config(BASE, 2), small_data_dir, 3)
    assert at_dp2[0]["step"] == 3 and at_dp2[0]["data"]["consumed_samples"] == 3 * 4
    # Resumed on one process, the next global batch is the dp=2 ranks' next batches, in rank order.
    resumed = dist.run(1, resume_then_peek, layout_config(BASE, 1), small_data_dir,
                       at_dp2[0]["data"])[0]
    expected_inputs = torch.cat([at_dp2[0]["next"][0], at_dp2[1]["next"][0]])
    assert torch.equal(resumed[0], expected_inputs)


def bf16_step(ctx, config_table, data_dir):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    metrics = trainer.train_step()
    dtypes = {p.dtype for p in trainer.model.parameters()} | {
        p.grad.dtype for p in trainer.model.parameters()}
    return metrics["loss"], dtypes


def test_bf16_autocast_keeps_fp32_master_weights_and_gradients(dist, small_data_dir):
    loss_fp32, _ = dist.run(2, bf16_step, layout_config(BASE, 2), small_data_dir)[0]
    autocast = layout_config({**BASE, "train.dtype": "bf16_autocast"}, 2)
    loss_bf16, dtypes = dist.run(2, bf16_step, autocast, small_data_dir)[0]
    assert dtypes == {torch.float32}
    # bf16 keeps 8 bits of mantissa: the first loss agrees to about 1%.
    assert abs(loss_bf16 - loss_fp32) / loss_fp32 < 1e-2
    assert loss_bf16 != loss_fp32  # autocast really ran in bf16
