"""CheckFree+'s out-of-order pipelining (``loom.pipeline.out_of_order``) against one process, fp32.

The runtime: pp = 4 ranks, one stage each, 4 microbatches: microbatches 1 and 3 run the blocks
of stages in the order (1, 0, 3, 2), the first two and the last two swapped. The loss and every
gradient equal one process that runs the whole model's pieces in the same orders (the
embedding, each stage's layers in the microbatch's block order, the head). The same process run
in order gives other gradients (so the swap is really there), and the pipeline's forward-only
run (evaluation) goes in order: its loss is the in-order loss. pp = 3 is refused by name.

The trainer: ``Trainer`` with ``fault.recovery = checkfree_plus`` at pp = 4 (8 layers, two per
stage; 4 microbatches; AdamW, clipping, warmup) trains three steps with the same loss, gradient
norm and every gradient as one process whose step runs the same microbatch orders over the
whole model, and the same validation loss (in order).

Tolerances: rtol 1e-5 / atol 1e-6 for one step, as tests/dist/test_skippipe_parity.py (the same
operations; only the order of the gradient accumulation differs); the trainer's later steps
those of tests/dist/test_pipeline_parity.py (Adam amplifies rounding).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from loom.models import PRESETS, build_model, reset_parameters
from loom.pipeline.out_of_order import OutOfOrderPipeline, block_order, is_swapped, visits
from loom.pipeline.partition import partition_model
from loom.pipeline.stage import build_stages
from loom.schedule.families import get
from loom.testing.parity import assert_parity, layout_config, train_and_record
from loom.train.trainer import Trainer
from tests.dist.test_pipeline_parity import ATOL, ATOL_FIRST, BASE, RTOL, RTOL_FIRST

SEED, MICRO, SEQ, STAGES, M = 7, 2, 16, 4, 4
ARGS = PRESETS["debug"]  # 4 layers: one per stage at pp = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, ARGS.vocab_size, (M, MICRO, SEQ + 1), generator=generator)
    return [t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / M


def _reference(out_of_order: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole model: each microbatch through the embedding, the stages' layers
    in its block order, and the head; the batch's loss and every parameter's gradient."""
    model = build_model(ARGS, device="meta")
    model.to_empty(device="cpu")
    reset_parameters(model, SEED)
    layers = partition_model(ARGS, STAGES, SEQ)
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    inputs, targets = _batch()
    total = 0.0
    for m in range(M):
        h = model.tok_embeddings(inputs[m])
        for stage in block_order(STAGES, m, out_of_order=out_of_order):
            for layer in layers[stage]:
                h = model.layers[str(layer)](h, cos, sin)
        loss = _loss(model.output(model.norm(h)), targets[m])
        loss.backward()
        total += loss.item()
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}


def _run(ctx, training: bool) -> dict:
    schedule = get("gpipe")(ctx.world_size, M)
    layers = partition_model(ARGS, ctx.world_size, SEQ)
    (stage,) = build_stages(ARGS, schedule, layers, ctx.rank, "cpu", SEED).values()
    pipeline = OutOfOrderPipeline(stage, list(range(ctx.world_size)), dist.group.WORLD, schedule)
    inputs, targets = _batch()
    loss = pipeline.step(inputs, targets, _loss, training=training,
                         activation_shape=(MICRO, SEQ, ARGS.dim))
    grads = {k: p.grad.clone() for k, p in stage.module.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def test_the_visit_orders_swap_the_first_two_and_last_two_stages_on_odd_microbatches():
    assert [is_swapped(m) for m in range(4)] == [False, True, False, True]
    assert block_order(4, 0) == (0, 1, 2, 3) and block_order(4, 1) == (1, 0, 3, 2)
    assert block_order(6, 3) == (1, 0, 2, 3, 5, 4)
    assert block_order(6, 3, out_of_order=False) == (0, 1, 2, 3, 4, 5)
    swapped = [(v.stage, v.part) for v in visits(4, 1)]
    assert swapped == [(0, "embed"), (1, "blocks"), (0, "blocks"), (3, "blocks"),
                       (2, "blocks"), (3, "head")]
    with pytest.raises(ValueError, match=r"needs pp >= 4; got pp = 3"):
        block_order(3, 0)


def test_out_of_order_training_equals_one_process_running_the_same_orders(dist):
    total, reference = _reference(out_of_order=True)
    in_order_total, in_order = _reference(out_of_order=False)
    # the swap changes the computation: otherwise this test could not tell it is there
    assert not torch.allclose(reference["layers.0.attention.wq.weight"],
                              in_order["layers.0.attention.wq.weight"], **TOL)
    results = dist.run(STAGES, _run, True)
    for rank, result in enumerate(results):
        assert abs(result["loss"] - total) <= 1e-5 * abs(total), rank
        assert result["grads"], rank
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference[name], **TOL,
                                       msg=lambda s, n=name: f"rank {rank} {n}: {s}")
    held = {name for result in results for name in result["grads"]}
    assert held == set(reference)  # every parameter got its gradient on some rank
    # evaluation runs in order and leaves no gradient
    for result in dist.run(STAGES, _run, False):
        assert abs(result["loss"] - in_order_total) <= 1e-5 * abs(in_order_total)
        assert result["grads"] == {}


class _OutOfOrderReference(Trainer):
    """One process, the whole model: each training microbatch through the embedding, the layers
    of the 4-stage partition in its block order, and the head; evaluation in order."""

    def _run_pipeline(self, batch, *, training: bool) -> torch.Tensor:
        micro = self.config.train.micro_batch_size
        inputs, targets = batch[0].split(micro), batch[1].split(micro)
        (stage,) = self.pipeline.stages.values()
        model, seq = stage.module, batch[0].shape[1]
        layers = partition_model(self.args, STAGES, self.config.data.seq_len)
        cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
        total = torch.zeros(())
        for m, (x, y) in enumerate(zip(inputs, targets)):
            with contextlib.nullcontext() if training else torch.no_grad():
                h = model.tok_embeddings(x)
                for s in block_order(STAGES, m, out_of_order=training):
                    for layer in layers[s]:
                        h = model.layers[str(layer)](h, cos, sin)
                loss = self.loss_fn(model.output(model.norm(h)), y) / len(inputs)
            if training:
                loss.backward()
            total = total + loss.detach()
        return total


def _record(ctx, config_table: dict, data_dir: str, steps: int, reference: bool) -> dict:
    """Per step: loss, grad norm and every named gradient; then the validation loss and which
    pipeline ran (``_OutOfOrderReference`` with ``reference``, else Loom's ``Trainer``)."""
    from loom.config import from_dict

    kind = _OutOfOrderReference if reference else Trainer
    trainer = kind(from_dict(config_table), Path(data_dir), None, ctx)
    record = train_and_record(trainer, steps)
    record["val_loss"] = trainer.evaluate()
    record["pipeline"] = type(trainer.pipeline).__name__
    return record


def test_the_trainer_under_checkfree_plus_equals_one_process_running_the_same_orders(
        dist, small_data_dir):
    base = {**BASE, "train.global_batch_size": M, "fault.recovery": "checkfree_plus"}
    steps = BASE["train.steps"]
    one = {k: v for k, v in base.items() if k != "fault.recovery"}
    reference = dist.run(1, _record, layout_config(one, 1), small_data_dir, steps, True)[0]
    config = layout_config(base, STAGES, pp=STAGES)
    results = dist.run(STAGES, _record, config, small_data_dir, steps, False)
    for rank, result in enumerate(results):
        assert result["pipeline"] == "OutOfOrderPipeline", rank
        label = f"checkfree_plus pp=4 rank {rank}"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)
        torch.testing.assert_close(torch.tensor(result["val_loss"]),
                                   torch.tensor(reference["val_loss"]), rtol=RTOL, atol=ATOL)
