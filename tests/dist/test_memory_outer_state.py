"""The memory estimator's state beside the optimizer (``loom.train.memory``): an outer loop's
snapshot and momentum (``parallel.dp_mode``) and gradient compression's residuals, against the
tensors the trainer allocates for them.

The estimate of a config minus the estimate of the same config under ``dp_mode = sync`` and no
compression is what the estimator charges for that state; the trainer's ``OuterLoop.state_dict``
(snapshot, momentum; co2's displacement and pending average) and its compressors' residuals are
what it holds. Debug model, fp32 unless said, gloo."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loom.config import from_dict
from loom.testing.parity import layout_config
from loom.train.memory import memory_instants
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.global_batch_size": 8,
        "train.micro_batch_size": 2}


def held_state_bytes(ctx, config_table: dict, data_dir: str) -> tuple[int, int]:
    """(this rank's pipeline rank, bytes of its outer-loop state and compression residuals)."""
    from torch.distributed.tensor import DTensor

    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    tensors = []
    if trainer.outer is not None:
        state = trainer.outer.state_dict()
        for key in ("snapshot", "momentum", "displacement", "pending"):
            tensors += list(state.get(key, {}).values())
    compressors = [getattr(r, "compressor", None) for r in trainer.pipeline.reducers.values()]
    for compressor in compressors + [trainer.expert_compressor]:
        if compressor is not None:
            tensors += list(compressor.residual)
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return trainer.pipeline.pp_rank or 0, sum(t.numel() * t.element_size() for t in local)


def charged_bytes(table: dict, pp_rank: int) -> float:
    """What the estimator charges pipeline rank ``pp_rank`` for that state."""
    plain = {**table, "parallel": {**table["parallel"], "dp_mode": "sync",
                                   "grad_compression": "none"}}

    def optimizer(config_table: dict) -> float:
        return max(e.optimizer for e in memory_instants(from_dict(config_table))
                   if e.rank == pp_rank)

    return optimizer(table) - optimizer(plain)


CASES = {  # name -> (world, parallel, overrides)
    "diloco": (2, {"dp_replicate": 2, "dp_mode": "diloco"}, {}),
    "co2": (2, {"dp_replicate": 2, "dp_mode": "co2"}, {}),
    # the masters are what it snapshots: 8 bytes per parameter, not the bf16 value's 2
    "noloco-bf16": (2, {"dp_replicate": 2, "dp_mode": "noloco"}, {"train.dtype": "bf16"}),
    # ZeRO-1's slices: each rank snapshots the slices its optimizer owns
    "diloco-zero1": (4, {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 1,
                         "dp_mode": "diloco"}, {}),
    "diloco-pp2": (4, {"dp_replicate": 2, "pp": 2, "dp_mode": "diloco"}, {}),
    "int8": (2, {"dp_replicate": 2, "grad_compression": "int8"}, {}),
    "powersgd-pp2": (4, {"dp_replicate": 2, "pp": 2, "grad_compression": "powersgd"}, {}),
    # the dense reducer's residuals and the expert shards' own compressor's
    "int8-ep2": (4, {"dp_replicate": 2, "ep": 2, "grad_compression": "int8"},
                 {"model.preset": "tiny-moe"}),
}


# CI: 16 bytes (co2), the masters (bf16), ZeRO-1's slices, both compressors under ep
@pytest.mark.parametrize("case", matrix(CASES, ci=["co2", "noloco-bf16", "diloco-zero1",
                                                   "int8-ep2"]))
def test_the_estimate_charges_what_the_trainer_holds(dist, small_data_dir, case):
    world, parallel, overrides = CASES[case]
    table = layout_config({**BASE, **overrides}, world, **parallel)
    held = dist.run(world, held_state_bytes, table, small_data_dir)
    for pp_rank, measured in held:
        assert measured > 0, case
        charged = charged_bytes(table, pp_rank)
        # ZeRO pads each bucket to a multiple of dp_shard elements: a few bytes more held
        slack = 8 * 64 * parallel.get("dp_shard", 1) if parallel.get("zero_stage") else 0
        assert math.isclose(charged, measured, abs_tol=slack), (case, pp_rank, charged,
                                                                 measured)
