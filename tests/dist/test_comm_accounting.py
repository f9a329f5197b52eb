"""Communication accounting through the trainer: the counted bytes of a data-parallel step equal
the analytical volume exactly."""

import pytest

from loom.config import from_dict
from loom.models import parameter_count
from loom.testing.parity import layout_config
from loom.config import model_args
from tests.conftest import SMALL_DATA_OVERRIDES

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 2,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "metrics.comm": True}


def one_step_ledger(ctx, config_table, data_dir):
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.train_step()
    return dict(trainer.ledger.records)


@pytest.mark.parametrize("d", [2, 4])
def test_data_parallel_step_moves_the_ring_all_reduce_volume(dist, small_data_dir, d):
    config = layout_config(BASE, d, dp_replicate=d)
    P = parameter_count(model_args(from_dict(config)))
    records = dist.run(d, one_step_ledger, config, small_data_dir)[0]
    record = records[("dp", "all_reduce")]
    # Gradients: every fp32 parameter once per step (accumulation skips the reduction on all but
    # the last microbatch), plus the 1-element fp32 loss for logging.
    payload = 4 * P + 4
    assert record.payload_bytes == payload
    # Ring all-reduce: each rank sends 2 (d-1)/d of the message (reduce-scatter + all-gather).
    assert record.wire_bytes / (2 * (d - 1) / d * payload) == 1.0
    assert set(records) == {("dp", "all_reduce")}  # nothing else is communicated
