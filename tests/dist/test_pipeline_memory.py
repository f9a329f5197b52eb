"""A split backward's activation memory follows the simulator's accounting (issue 20 item 2).

Two real ranks run one ZB-V and one ZB-H2 step of a small model whose activations dominate (a
tiny vocabulary), with the recorder counting autograd's saved tensors plus what each stage keeps
from an I to its W (``loom.pipeline.profile``). Checked:

* after every I, a (stage, microbatch) holds what its W needs and nothing more: its blocks'
  ``block_weight_grad_bytes`` (each linear's input and output gradient), plus the head's input
  and logits gradient on the last stage and the embedding output's gradient on the first;
* each rank's measured peak is within 10% of ``loom.schedule.simulate``'s peak with the measured
  per-stage F bytes and ``weight_grad_fraction`` from the formulas (nothing calibrated from the
  run).

A retaining split (the whole graph held until W) fails both: it holds 1.4x F's bytes after I, and
ZB-H2's second rank peaks 22% above the prediction (the test asserts that the f = 1 accounting
is that far off, so the sizes keep the check able to fail). ZB-V's peak is reached before any W
is pending, so on it only the first check tells the two splits apart.
"""

from __future__ import annotations

import pytest

P, M, SEQ, MICRO = 2, 4, 64, 2
SHAPE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=32,
             max_seq_len=SEQ)


def recorded_step(ctx, family: str):
    import torch
    import torch.nn.functional as F

    from loom.models import TransformerArgs
    from loom.pipeline.partition import partition_model
    from loom.pipeline.profile import PipelineRecorder
    from loom.pipeline.runtime import PipelineRuntime
    from loom.pipeline.stage import build_stages
    from loom.schedule.select import schedule_for

    torch.set_num_threads(1)
    args = TransformerArgs(**SHAPE)
    schedule = schedule_for(family, P, M)
    layers = partition_model(args, schedule.num_stages, SEQ)
    stages = build_stages(args, schedule, layers, ctx.rank, "cpu", seed=5)
    runtime = PipelineRuntime(schedule, stages, ctx.rank, range(P), None)
    runtime.recorder = PipelineRecorder(ctx.rank, track_memory=True,
                                        modules=[stage.module for stage in stages.values()])
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, args.vocab_size, (MICRO, SEQ), generator=generator)
              for _ in range(M)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / M

    runtime.step(inputs, inputs, loss_fn, activation_shape=(MICRO, SEQ, args.dim))
    return schedule, [len(layer) for layer in layers], runtime.recorder.profile


@pytest.mark.parametrize("family", ["zbv", "zb_h2"])
def test_split_backward_peak_follows_the_simulator(dist, family):
    from loom.formulas.memory import block_activation_bytes, block_weight_grad_bytes
    from loom.pipeline.profile import peak_saved_bytes
    from loom.schedule import simulate
    from loom.schedule.cost import StageCosts

    results = dist.run(P, recorded_step, family)
    schedule, layer_counts = results[0][0], results[0][1]
    profiles = [profile for _, _, profile in results]
    h, e, tokens = SHAPE["dim"], 4, SEQ * MICRO
    sizes = dict(s=SEQ, b=MICRO, h=h, f=SHAPE["ffn_dim"], a=SHAPE["n_heads"],
                 kv=SHAPE["n_kv_heads"])
    fraction = block_weight_grad_bytes(**sizes) / block_activation_bytes(**sizes)

    forward: dict[int, list[int]] = {}
    for profile in profiles:
        for (stage, mb), saved in profile.forward_bytes.items():
            forward.setdefault(stage, []).append(saved)
            held = profile.after_input_grad[stage, mb]
            needed = layer_counts[stage] * block_weight_grad_bytes(**sizes)
            if schedule.is_last(stage):  # the final norm's output and the logits' gradient
                needed += tokens * (h + SHAPE["vocab_size"]) * e
            if schedule.is_first(stage):  # the embedding output's gradient
                needed += tokens * h * e
            assert abs(held / needed - 1) < 0.02, (
                f"{family} stage {stage} microbatch {mb}: {held} B held after I (F saved"
                f" {saved}), W needs {needed}")

    per_stage = tuple(sum(forward[s]) / len(forward[s]) for s in range(schedule.num_stages))
    # A rank's memory curve depends only on its own order of actions, so unit durations do.
    predicted, held_all = (
        simulate(schedule, StageCosts.uniform(1, 1, 1, activation=per_stage,
                                              weight_grad_fraction=f)).peak_memory
        for f in (fraction, 1))
    measured = [peak_saved_bytes(p, 0) for p in sorted(profiles, key=lambda p: p.rank)]
    for rank, (got, want) in enumerate(zip(measured, predicted)):
        assert abs(got / float(want) - 1) < 0.10, (
            f"{family} rank {rank}: measured peak {got} B, simulated {float(want):.0f} B")
    if family == "zb_h2":  # the check can fail: holding everything until W is far off
        assert max(float(w) / g for w, g in zip(held_all, measured)) > 1.15
