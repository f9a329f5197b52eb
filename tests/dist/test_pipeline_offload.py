"""PipeOffload in the runtime (issue 22 item 5): offload/reload actions change where a
microbatch's saved activations live, never a number.

On p real ranks (gloo, CPU), one step of a small model runs a family's schedule and then the same
schedule with ``loom.schedule.offload.insert_offload``'s offloads and reloads, from the same
seeded weights and data: the loss and every parameter's gradient must be bit-identical (the
copies are exact), the offloading ranks must have moved bytes (on CPU the "host" copy is a
separate tensor: it proves the path runs, it frees nothing real), and the ranks the policy left
alone must have moved none. 1F1B (full backward B), ZB-V (split I/W: the freeing split reads a
matmul's saved input in I, after the reload) and interleaved 1F1B (two stages per rank).
"""

from __future__ import annotations

import pytest

SEQ, MICRO = 16, 2
SHAPE = dict(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
             max_seq_len=SEQ)


def offloaded_and_plain(ctx, family: str, p: int, m: int, limit: float):
    import torch
    import torch.nn.functional as F

    from loom.models import TransformerArgs
    from loom.pipeline.partition import partition_model
    from loom.pipeline.runtime import PipelineRuntime
    from loom.pipeline.stage import build_stages
    from loom.schedule.offload import insert_offload
    from loom.schedule.select import schedule_for
    from loom.schedule.validate import validate

    torch.set_num_threads(1)
    args = TransformerArgs(**SHAPE)
    plain = schedule_for(family, p, m)
    offloaded = insert_offload(plain, limit)
    validate(offloaded, memory_limit=limit)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, args.vocab_size, (MICRO, SEQ), generator=generator)
              for _ in range(m)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / m

    results = []
    for schedule in (plain, offloaded):
        layers = partition_model(args, schedule.num_stages, SEQ)
        stages = build_stages(args, schedule, layers, ctx.rank, "cpu", seed=5)
        runtime = PipelineRuntime(schedule, stages, ctx.rank, range(p), None)
        loss = runtime.step(inputs, inputs, loss_fn, activation_shape=(MICRO, SEQ, args.dim))
        grads = {f"{index}.{name}": param.grad.clone()
                 for index, stage in sorted(stages.items())
                 for name, param in stage.module.named_parameters() if param.grad is not None}
        moved = sum(1 for action in schedule.actions[ctx.rank] if action.op.value == "O")
        results.append((loss.clone(), grads, runtime.offload_bytes, moved))
    return results


# (family, p, limit): each limit below the family's peak, so that the policy moves something;
# 1F1B at p = 2 holds 2 units, what one offload needs (one F computing, one copy in flight)
CASES = [("zbv", 2, 1.5), ("interleaved_1f1b", 2, 2), ("dualpipev", 2, 2),
         ("1f1b", 4, 2), ("zbv", 4, 3.5), ("interleaved_1f1b", 4, 2)]


@pytest.mark.parametrize("family,p,limit", CASES)
def test_offload_is_bit_identical(dist, family, p, limit):
    results = dist.run(p, offloaded_and_plain, family, p, 2 * p, limit)
    assert any(offloaded[3] for _, offloaded in results), "the policy moved nothing"
    for plain, offloaded in results:
        assert offloaded[0].item() == plain[0].item()
        assert plain[1].keys() == offloaded[1].keys() and plain[1]
        for name, grad in plain[1].items():
            assert offloaded[1][name].equal(grad), name
        assert plain[2] == 0
        assert (offloaded[2] > 0) == (offloaded[3] > 0)  # bytes moved exactly where it offloads


def trained(ctx, config_table: dict, data_dir: str, steps: int) -> list:
    """Per step: loss, grad norm, every named gradient, and the bytes this rank offloaded."""
    from pathlib import Path

    import torch

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    out = []
    for _ in range(steps):
        metrics = trainer.train_step()
        out.append((metrics["loss"], metrics["grad_norm"],
                    {k: v.cpu() for k, v in trainer.named_gradients().items()},
                    trainer.pipeline.offload_bytes))
    return out


def test_config_limit_trains_bit_identically(dist, small_data_dir):
    """``parallel.schedule_offload_limit = 2`` through ``loom.config`` and the trainer: two
    optimizer steps of 1F1B at pp = 4 give the same bits as without it, and the ranks that hold
    more than 2 units without it (ranks 0 and 1) offload."""
    from loom.testing.parity import layout_config
    from tests.conftest import SMALL_DATA_OVERRIDES

    base = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_layers": 4,
            "train.steps": 2, "train.micro_batch_size": 1, "train.global_batch_size": 8,
            "optim.warmup_steps": 1, "parallel.schedule": "1f1b"}
    plain = dist.run(4, trained, layout_config(base, 4, pp=4), small_data_dir, 2)
    offloaded = dist.run(4, trained, layout_config(
        {**base, "parallel.schedule_offload_limit": 2}, 4, pp=4), small_data_dir, 2)
    for rank, (without, with_) in enumerate(zip(plain, offloaded)):
        for step, (a, b) in enumerate(zip(without, with_)):
            assert a[0] == b[0] and a[1] == b[1], (rank, step)
            assert a[2].keys() == b[2].keys()
            for name, grad in a[2].items():
                assert b[2][name].equal(grad), (rank, step, name)
            assert a[3] == 0 and (b[3] > 0) == (rank in (0, 1)), (rank, b[3])
