"""The pipeline recorder (``loom.pipeline.profile``) on 4 real ranks, small and fast.

One step of a tiny model under 1F1B (full backwards) and ZB-V (split backwards, V placement):
the recorder sees every action of the rank's schedule exactly once, in order, with
non-decreasing times; the measured trace is valid JSON with one process per rank; saved-tensor
bytes return to zero after the step; and turning the recorder on changes no number (loss and
every gradient bit-identical to a run without it).
"""

from __future__ import annotations

import json

import pytest

P, M, SEQ, MICRO = 4, 4, 16, 2


def profiled_step(ctx, family: str, record: bool, track_memory: bool):
    import torch
    import torch.nn.functional as F

    from loom.models import TransformerArgs
    from loom.pipeline.partition import partition_model
    from loom.pipeline.profile import PipelineRecorder
    from loom.pipeline.runtime import PipelineRuntime
    from loom.schedule.select import schedule_for
    from loom.pipeline.stage import build_stages

    torch.set_num_threads(1)
    args = TransformerArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64,
                           vocab_size=64, max_seq_len=SEQ)
    schedule = schedule_for(family, P, M)
    stages = build_stages(args, schedule, partition_model(args, schedule.num_stages, SEQ),
                          ctx.rank, "cpu", seed=7)
    runtime = PipelineRuntime(schedule, stages, ctx.rank, range(P), None)
    if record:
        modules = [stage.module for stage in stages.values()]
        runtime.recorder = PipelineRecorder(ctx.rank, track_memory=track_memory, modules=modules)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 64, (MICRO, SEQ), generator=generator) for _ in range(M)]
    targets = [torch.randint(0, 64, (MICRO, SEQ), generator=generator) for _ in range(M)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / M

    loss = runtime.step(inputs, targets, loss_fn, activation_shape=(MICRO, SEQ, args.dim))
    grads = {f"{s}.{n}": p.grad.clone() for s, stage in stages.items()
             for n, p in stage.module.named_parameters()}
    profile = runtime.recorder.profile if record else None
    return schedule, loss, grads, profile


@pytest.mark.parametrize("family", ["1f1b", "zbv"])
def test_recorder_sees_every_action_once_and_changes_nothing(dist, family):
    import torch

    from loom.pipeline.profile import chrome_trace, measured_result, peak_saved_bytes

    plain = dist.run(P, profiled_step, family, False, False)
    recorded = dist.run(P, profiled_step, family, True, True)
    schedule = recorded[0][0]
    for rank in range(P):
        _, loss, grads, profile = recorded[rank]
        assert torch.equal(loss, plain[rank][1]), f"rank {rank}: loss changed by the recorder"
        assert grads.keys() == plain[rank][2].keys()
        for name, grad in grads.items():
            assert torch.equal(grad, plain[rank][2][name]), f"rank {rank}: {name} changed"
        (step,) = profile.steps
        tokens = [token for token, _, _ in step.actions]
        assert tokens == [str(a) for a in schedule.actions[rank]], f"rank {rank}: actions differ"
        times = [step.begin] + [t for _, s, e in step.actions for t in (s, e)] + [step.end]
        assert times == sorted(times), f"rank {rank}: times go backwards"
        # Every saved tensor is freed by the backward pieces of the same step.
        assert step.memory[-1][1] == 0 and peak_saved_bytes(profile, 0) > 0
        assert set(profile.forward_bytes) == {(a.stage, a.microbatch)
                                              for a in schedule.actions[rank] if a.op.value == "F"}
    profiles = [r[3] for r in recorded]
    trace = json.loads(json.dumps(chrome_trace(schedule, profiles, 0)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == set(range(P))
    assert len(complete) == sum(len(row) for row in schedule.actions)
    result = measured_result(schedule, profiles, 0)
    assert result.makespan > 0 and len(result.timeline) == P
