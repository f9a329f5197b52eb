"""Varlen microbatches (``data.packing = varlen``) through the real ``Trainer``: token budgets of
whole document pieces with no padding, and the loss the mean over the step's predictions
however they are spread over microbatches and ranks.

The corpus is short text files of very different lengths (mostly 3 to 30 bytes, one in ten 40
to 120; byte tokens). Split length (``seq_len``) 32 and microbatches of at most 48 predictions,
four per step (``global_batch_tokens`` 192): documents longer than a microbatch are cut into
pieces that land in different microbatches, every microbatch holds several documents and its
own token count, so a mean of per-microbatch or per-rank means would differ from the
token-weighted mean, attention across a boundary would change every number, and a pipeline
must carry activations of a different length per microbatch.

* One process: the trainer's first loss and every gradient equal the same seeded model run on
  each piece alone (from position 0), summed and divided by the step's predictions.
* Layouts: dp2 with ``data.balance = tokens`` (the step's pieces dealt to other microbatches
  than one process's ``none``: only the order of the sums changes), tp2 (vocab-parallel head
  and loss), pp2 with 1F1B (four microbatches of four lengths through the pipeline) and pp2
  with ZB-V (I/W split) each equal one process (loss, gradient norm and every gradient, 2
  AdamW steps); marked slow: pp2 x dp2 and ZeRO-3 on dp_shard 2.
* Mixed sources (``data.mix``: the short documents at 0.6 and a source of long ones, 200 to
  400 bytes, at 0.4, so a step holds pieces of both): dp2 with ``tokens`` (CI) and pp2 1F1B
  (matrix) equal one process on the same mixture.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from loom.config import from_dict
from loom.data.varlen import plan_step
from loom.data.loader import prepare_data
from loom.testing.parity import assert_parity, layout_config, record_training
from loom.train.trainer import Trainer
from tests.conftest import matrix
from tests.data_fixtures import DataCfg, prepared_documents, write_short_documents

STEPS = 2
SEQ_LEN = 32  # the split length
BUDGET = 48  # data.tokens_per_microbatch
STEP_TOKENS = 4 * BUDGET
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = {  # name: (world, degrees, extra overrides)
    # the same pieces per step dealt to other microbatches: only the summation order changes
    "dp2-tokens": (2, {"dp_replicate": 2}, {"data.balance": "tokens"}),
    "tp2-vocab": (2, {"tp": 2, "dp_replicate": 1}, {"parallel.vocab_parallel": True}),
    "pp2-1f1b": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "pp2-zbv": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "zbv"}),
    # two pipelines whose microbatches differ in length from each other's
    "pp2-dp2": (4, {"pp": 2, "dp_replicate": 2}, {"parallel.schedule": "1f1b"}),
    "zero3-dp2": (2, {"dp_shard": 2, "dp_replicate": 1}, {}),
}
SLOW = {"pp2-dp2", "zero3-dp2"}  # nothing new for varlen beyond the others: not in CI's budget


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[str, dict]:
    """A prepared data directory of short documents and the overrides that match it."""
    data_dir, overrides = prepared_documents(tmp_path_factory, "varlen_docs", SEQ_LEN, count=300,
                                             seed=23)
    overrides.update({"data.packing": "varlen", "data.tokens_per_microbatch": BUDGET, "train.global_batch_tokens": STEP_TOKENS, "model.preset": "tiny", "train.steps": STEPS})
    return data_dir, overrides


def first_step_against_pieces_alone(ctx, config_table: dict, data_dir: str) -> dict:
    """The trainer's first loss and gradients, and the same computed piece by piece (each alone,
    from position 0) with a copy of its initial model; and what the step holds."""
    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    (stage,) = trainer.pipeline.stages.values()
    model = copy.deepcopy(stage.module)
    loader = trainer.loader
    position = loader.state_dict()
    batch = loader.next_batch()
    loader.load_state_dict(position)  # the step below trains on the same batch
    plan, _ = plan_step(loader.sampler.indices, 0, loader.dataset.lengths, loader.num_bins,
                        loader.budget, loader.balance)
    pieces = loader.dataset.pieces
    predictions = (loader.dataset.offsets[1:] - loader.dataset.offsets[:-1] - 1)
    split_documents = int((predictions[pieces.document[plan.pieces]] > BUDGET).sum())
    total, tokens = torch.zeros(()), 0
    for mb in batch.microbatches:
        ids = mb.document_ids[0].tolist()
        starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
        for begin, end in zip(starts, starts[1:]):
            logits = model(mb.inputs[:, begin:end])  # alone, from position 0
            total = total + F.cross_entropy(logits[0], mb.targets[0, begin:end], reduction="sum")
            tokens += end - begin
    (total / tokens).backward()
    loss = trainer.train_step()["loss"]
    got = trainer.named_gradients()
    return {"trainer": loss, "pieces": (total / tokens).item(),
            "grads": {n: (got[n].cpu(), p.grad) for n, p in model.named_parameters()},
            "lengths": [mb.inputs.shape[1] for mb in batch.microbatches],
            "documents_per_microbatch": [len(set(mb.document_ids[0].tolist()))
                                         for mb in batch.microbatches],
            "split_documents": split_documents, "tokens": tokens}


def test_the_loss_and_gradients_equal_each_piece_alone(dist, short_documents):
    data_dir, base = short_documents
    config = layout_config({**base, "train.grad_clip": 0.0}, 1)
    got = dist.run(1, first_step_against_pieces_alone, config, data_dir)[0]
    # the case is not trivial: microbatches of different lengths, no padding, several documents
    # in each, a document longer than a microbatch split over microbatches
    assert len(got["lengths"]) == 4 and len(set(got["lengths"])) > 1
    assert all(length <= BUDGET for length in got["lengths"])
    assert sum(got["lengths"]) == got["tokens"] > STEP_TOKENS - 4 * SEQ_LEN
    assert min(got["documents_per_microbatch"]) > 1 and got["split_documents"] > 0
    assert got["trainer"] == pytest.approx(got["pieces"], rel=1e-5)
    for name, (trainer_grad, piece_grad) in got["grads"].items():
        torch.testing.assert_close(trainer_grad, piece_grad, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.fixture(scope="module")
def reference(dist, short_documents):
    data_dir, base = short_documents
    return dist.run(1, record_training, layout_config(base, 1), data_dir, STEPS)[0]


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW
                                    else name for name in LAYOUTS])
def test_varlen_layouts_match_one_process(dist, short_documents, reference, layout):
    data_dir, base = short_documents
    _assert_layout_matches(dist, data_dir, base, LAYOUTS[layout], reference, layout)


def _assert_layout_matches(dist, data_dir: str, base: dict, layout: tuple, reference: dict,
                           label: str) -> None:
    """Every rank of ``layout`` (world, degrees, overrides) equals one process's ``reference``
    (the first step at the tight tolerances), and the reference learns."""
    world, degrees, extra = layout
    config = layout_config({**base, **extra}, world, **degrees)
    for rank, got in enumerate(dist.run(world, record_training, config, data_dir, STEPS)):
        where = f"{label} rank {rank}"
        assert_parity(reference, got, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=where,
                      steps=range(1))
        assert_parity(reference, got, rtol=RTOL, atol=ATOL, label=where)
    assert reference["loss"][-1] < reference["loss"][0]


@pytest.fixture(scope="module")
def mixed_documents(tmp_path_factory, short_documents) -> tuple[str, dict]:
    """A data directory mixing the short documents (0.6) with a source of long ones (0.4)."""
    _, base = short_documents
    short = tmp_path_factory.mktemp("varlen_mix_short")
    write_short_documents(short, 300, 23)
    long = tmp_path_factory.mktemp("varlen_mix_long")
    for i in range(40):
        (long / f"long{i:03d}.txt").write_text("qrstuvwxyz"[i % 10] * (200 + 5 * i))
    mix = f"{short}:0.6,{long}:0.4"
    out = tmp_path_factory.mktemp("varlen_mix_data")
    prepare_data(DataCfg(mix=mix, extensions=(".txt",), seq_len=SEQ_LEN, val_fraction=0.1), out)
    overrides = {key: value for key, value in base.items() if key != "data.source"}
    return str(out), {**overrides, "data.mix": mix}


MIXED = {"dp2-tokens": LAYOUTS["dp2-tokens"], "pp2-1f1b": LAYOUTS["pp2-1f1b"]}


@pytest.mark.parametrize("layout", matrix(MIXED, ci=["dp2-tokens"]))
def test_mixed_sources_match_one_process(dist, mixed_documents, layout):
    data_dir, base = mixed_documents
    reference = dist.run(1, record_training, layout_config(base, 1), data_dir, STEPS)[0]
    _assert_layout_matches(dist, data_dir, base, MIXED[layout], reference, f"mixed {layout}")
