"""Packed rows (``data.packing = pack``) through the real ``Trainer``: the loss is the mean over
the step's real tokens however they are spread, and every layout equals one process.

The corpus is short text files of very different lengths (mostly 3 to 30 bytes, one in ten 40
to 120, byte tokens, rows of 32 tokens), so rows hold several documents, end in padding, and microbatches and data-parallel
ranks hold different numbers of real tokens: a mean of per-microbatch means, or of per-rank
means, would differ from the token-weighted mean, and attention across a boundary would change
every number.

* One process: the trainer's first loss equals the cross entropy over the batch's real tokens of
  the same seeded model run document by document (each document alone, from position 0).
* Microbatching does not change the step: micro_batch_size 1 equals 2 (loss, norm, gradients).
* Layouts: dp2, tp2 (without and with the vocab-parallel head and loss, which sums over real
  targets only), pp2 with 1F1B and with ZB-V (I/W split), ZeRO-3 on dp_shard 2, and pp2 x dp2
  each equal one process (loss, gradient norm and every gradient, 2 AdamW steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from loom.config import from_dict
from loom.data.packing import IGNORE_INDEX
from loom.testing.parity import assert_parity, layout_config, record_training
from loom.train.trainer import Trainer
from tests.conftest import matrix
from tests.data_fixtures import prepared_documents

STEPS = 2
SEQ_LEN = 32
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = {  # name: (world, degrees, extra overrides)
    "dp2": (2, {"dp_replicate": 2}, {}),
    "tp2": (2, {"tp": 2, "dp_replicate": 1}, {"parallel.vocab_parallel": False}),
    "tp2-vocab": (2, {"tp": 2, "dp_replicate": 1}, {"parallel.vocab_parallel": True}),
    "pp2-1f1b": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "pp2-zbv": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "zbv"}),
    "zero3-dp2": (2, {"dp_shard": 2, "dp_replicate": 1}, {}),
    "pp2-dp2": (4, {"pp": 2, "dp_replicate": 2}, {"parallel.schedule": "1f1b"}),
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[str, dict]:
    """A prepared data directory of short documents and the overrides that match it."""
    data_dir, overrides = prepared_documents(tmp_path_factory, "short_docs", SEQ_LEN, count=600,
                                             seed=17)
    overrides.update({"data.packing": "pack", "model.preset": "tiny", "train.steps": STEPS, "train.global_batch_size": 8, "train.micro_batch_size": 2})
    return data_dir, overrides


def first_loss_against_documents_alone(ctx, config_table: dict, data_dir: str) -> dict:
    """The trainer's first loss and the token-weighted loss of its batch computed document by
    document with a copy of its initial model."""
    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    (stage,) = trainer.pipeline.stages.values()
    model = copy.deepcopy(stage.module)
    position = trainer.loader.state_dict()
    batch = trainer.loader.next_batch()
    trainer.loader.load_state_dict(position)  # the step below trains on the same batch
    total, tokens, rows_with_several = 0.0, 0, 0
    with torch.no_grad():
        for row in range(batch.inputs.shape[0]):
            ids = batch.document_ids[row]
            starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
            rows_with_several += len(starts) > 2
            for begin, end in zip(starts, starts[1:] + [len(ids)]):
                targets = batch.targets[row, begin:end]
                if (targets == IGNORE_INDEX).all():  # the row's padding
                    continue
                logits = model(batch.inputs[row:row + 1, begin:end])  # alone, from position 0
                total += F.cross_entropy(logits[0], targets, reduction="sum").item()
                tokens += int((targets != IGNORE_INDEX).sum())
    loss = trainer.train_step()["loss"]
    padding = int((batch.targets == IGNORE_INDEX).sum())
    return {"trainer": loss, "documents": total / tokens, "padding": padding,
            "rows_with_several": rows_with_several}


def test_the_loss_is_the_mean_over_real_tokens_of_each_document_alone(dist, short_documents):
    data_dir, base = short_documents
    got = dist.run(1, first_loss_against_documents_alone, layout_config(base, 1), data_dir)[0]
    assert got["padding"] > 0 and got["rows_with_several"] > 0  # the case is not trivial
    assert got["trainer"] == pytest.approx(got["documents"], rel=1e-5)


@pytest.fixture(scope="module")
def reference(dist, short_documents):
    data_dir, base = short_documents
    return dist.run(1, record_training, layout_config(base, 1), data_dir, STEPS)[0]


def test_microbatching_does_not_change_the_step(dist, short_documents, reference):
    data_dir, base = short_documents
    config = layout_config({**base, "train.micro_batch_size": 1}, 1)
    got = dist.run(1, record_training, config, data_dir, STEPS)[0]
    assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label="micro 1 vs 2")


@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[name for name in LAYOUTS
                                                       if name != "pp2-1f1b"]))
def test_packed_layouts_match_one_process(dist, short_documents, reference, layout):
    data_dir, base = short_documents
    world, degrees, extra = LAYOUTS[layout]
    config = layout_config({**base, **extra}, world, **degrees)
    for rank, got in enumerate(dist.run(world, record_training, config, data_dir, STEPS)):
        where = f"{layout} rank {rank}"
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
    assert reference["loss"][-1] < reference["loss"][0]
