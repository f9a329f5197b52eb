"""The pipeline's point-to-point traffic is counted in the ledger and equals the analytical volume.

With ``metrics.comm = true`` the runtime's sends, receives and its loss all-reduce go through
``loom.parallel.comm`` on axis "pp". Per step, every microbatch crosses every stage boundary whose
two stages sit on different ranks twice: its activation forward and its gradient backward, each
``b·s·h`` fp32 values (micro batch, sequence, model dim), divided by tp under sequence
parallelism (each tp rank sends its sequence shard). A boundary inside one rank (the turn of a
V placement) moves nothing. So rank r sends m·b·s·h·4 bytes per crossing boundary it feeds
forward (it holds stage s, another rank s+1) and per one it feeds backward (it holds s+1, another
rank s), receives the same counts, and all-reduces the 4-byte loss once. The counted bytes must
equal that exactly (ratio 1.00), for steps 1 and 2: 1F1B, interleaved 1F1B (2 chunks), ZB-V (one
boundary inside a rank) and 1F1B x tp2 with sequence parallelism.
"""

from __future__ import annotations

import pytest

from loom.schedule.select import schedule_for
from loom.testing.parity import layout_config
from tests.conftest import SMALL_DATA_OVERRIDES
from tests.dist.test_pipeline_parity import record_pipeline

MICRO = 4  # microbatches per pipeline
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": 2,
        "train.micro_batch_size": 1, "train.global_batch_size": MICRO, "train.eval_batches": 1,
        "optim.warmup_steps": 1, "metrics.comm": True}
LAYOUTS = {  # name -> (world size, parallel settings)
    "1f1b": (2, {"pp": 2, "schedule": "1f1b"}),
    "interleaved-2-chunks": (2, {"pp": 2, "schedule": "interleaved_1f1b", "chunks": 2}),
    "zbv": (2, {"pp": 2, "schedule": "zbv"}),
    "1f1b-tp2-sp": (4, {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "1f1b"}),
}


def pp_records(trainer) -> dict:
    """This step's ``pp`` ledger entries (calls, payload, wire) and the rank's pipeline rank;
    then the ledger is reset for the next step."""
    out = {f"{op}": (r.calls, r.payload_bytes, r.wire_bytes)
           for (axis, op), r in trainer.ledger.records.items() if axis == "pp"}
    out["pp_rank"] = trainer.pipeline.pp_rank
    trainer.ledger.reset()
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_p2p_bytes_equal_the_activation_volume(dist, small_data_dir, tmp_path, layout):
    from loom.models import preset

    world, parallel = LAYOUTS[layout]
    config = layout_config(BASE, world, **parallel)
    results = dist.run(world, record_pipeline, config, small_data_dir, 2, str(tmp_path),
                       pp_records)
    schedule = schedule_for(parallel["schedule"], 2, MICRO, parallel.get("chunks", 0))
    args = preset("debug")
    tp = parallel.get("tp", 1) if parallel.get("sequence_parallel") else 1
    message = 1 * SMALL_DATA_OVERRIDES["data.seq_len"] * args.dim * 4 // tp  # b·s·h fp32 (/tp)
    crossing = [s for s in range(schedule.num_stages - 1)
                if schedule.rank_of(s) != schedule.rank_of(s + 1)]
    for rank, result in enumerate(results):
        for step, records in enumerate(result["observed"]):
            p = records["pp_rank"]
            sends = MICRO * sum((schedule.rank_of(s) == p) + (schedule.rank_of(s + 1) == p)
                                for s in crossing)
            where = f"{layout} rank {rank} step {step + 1}: {records}"
            assert records["send"] == (sends, sends * message, sends * message), where
            assert records["recv"] == (sends, sends * message, 0.0), where  # counted at sender
            # The loss; under tp also the clipping norm (tensor.clip_grad_norm sums it over pp
            # through comm.py), 4 bytes each.
            reductions = 2 if "tp" in parallel else 1
            assert records["all_reduce"] == (reductions, 4 * reductions,
                                             reductions * 2 * (2 - 1) / 2 * 4), where
            ratio = records["send"][2] / (sends * message)
            assert ratio == 1.0, where
