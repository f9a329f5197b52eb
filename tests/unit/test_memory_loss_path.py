"""The loss path's bytes in the memory estimator (issue 20): what the head and the cross entropy
hold, counted tensor by tensor, and a measured one-rank bf16 step at a large vocabulary.

``F.cross_entropy`` is log_softmax then nll_loss: the forward saves the fp32 log-probabilities
only (not the logits, nor their fp32 copy); its backward holds nll_loss's fp32 gradient and
log_softmax's output (the logits' fp32 gradient) beside them, before the output layer's
backward makes the head's weight gradient. At a 128,256-wide vocabulary that instant is the
step's peak; counting the bf16 logits instead put the estimate of 4 layers of Llama-3-8B's
shape 12% under an H100's measured peak at 8192 tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from loom.config import load_config, model_args, resolve
from loom.formulas.memory import head_activation_bytes, loss_backward_bytes
from loom.models.llama import Transformer
from loom.train.memory import estimate_memory, layer_activation_bytes, memory_instants

# debug preset (dim 64), one layer, a vocabulary large enough that the loss path dominates
SEQ, BATCH, VOCAB = 128, 2, 16_384
N = SEQ * BATCH


def config(world: int = 1, **over: str):
    return resolve(load_config(None, {
        "model.preset": "debug", "model.n_layers": "1", "model.vocab_size": str(VOCAB),
        "data.seq_len": str(SEQ), "train.micro_batch_size": str(BATCH),
        "train.global_batch_size": str(BATCH * world), "train.dtype": "bf16", **over}), world)


def test_the_head_saves_the_log_probabilities_not_the_logits():
    """Final norm (input and output at e bytes, fp32 rstd) and the fp32 log-probabilities."""
    assert head_activation_bytes(s=SEQ, b=BATCH, h=64, vocab=VOCAB, e=2) == \
        2 * N * 64 * 2 + 4 * N + 4 * N * VOCAB


def test_the_loss_backward_holds_two_fp32_gradients_or_the_fused_softmax_clone():
    assert loss_backward_bytes(tokens=N, vocab=VOCAB) == 2 * 4 * N * VOCAB
    assert loss_backward_bytes(tokens=N, vocab=VOCAB // 2, fused=True) == 4 * N * VOCAB // 2


def test_the_peak_is_the_loss_backward_before_the_heads_gradient():
    """One microbatch, no ZeRO: the worst instant holds every activation, the loss's two fp32
    gradients, and no gradient at all (zero_grad freed them; the head's is not made yet)."""
    cfg = config()
    peak = estimate_memory(cfg)
    assert any("loss's backward" in note for note in peak.notes)
    assert peak.gradients == 0
    head = head_activation_bytes(s=SEQ, b=BATCH, h=64, vocab=VOCAB, e=2)
    assert peak.activations == layer_activation_bytes(cfg) + head + 8 * N * VOCAB
    # every other instant with activations holds less
    others = [e for e in memory_instants(cfg) if not any("loss's" in n for n in e.notes)]
    assert max(e.total for e in others) < peak.total


def test_vocabulary_parallel_loss_holds_its_share_and_one_clone():
    """tp 2: the fused vocab-parallel loss keeps the softmax of V/2 columns and clones it in
    its backward; without vocabulary parallelism the gathered logits take the plain loss."""
    for vocab_parallel, width, per_logit in (("true", VOCAB // 2, 4), ("false", VOCAB, 8)):
        cfg = config(2, **{"parallel.tp": "2", "parallel.vocab_parallel": vocab_parallel})
        loss = [e for e in memory_instants(cfg) if any("loss's" in n for n in e.notes)]
        plain = [e for e in memory_instants(cfg) if e.gradients and e.activations
                 and not any("loss's" in n for n in e.notes)]
        assert loss and plain
        head = head_activation_bytes(s=SEQ, b=BATCH, h=64, vocab=width, e=2)
        assert loss[0].activations == layer_activation_bytes(cfg) + head + per_logit * N * width


def _live_peak(trace: Path) -> int:
    """Most bytes live at once, from the profiler's CPU allocation events."""
    events = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                     if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    sizes: dict[int, int] = {}
    live = peak = 0
    for event in events:
        nbytes, addr = event["args"]["Bytes"], event["args"]["Addr"]
        if nbytes > 0:
            sizes[addr] = nbytes
            live += nbytes
        elif addr in sizes:
            live -= sizes.pop(addr)
        peak = max(peak, live)
    return peak


def test_a_measured_bf16_step_peaks_where_the_estimate_says(tmp_path):
    """A bf16 model's forward, loss and backward (no gradients before it, as after zero_grad):
    the most bytes live beyond the parameters are the estimate's activations at the loss's
    backward, within 5% (8 bytes over on this machine's torch: the rest are a few scalars)."""
    cfg = config()
    torch.manual_seed(0)
    model = Transformer(model_args(cfg)).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(),
                               tokens[:, 1:].flatten(0, 1))
        loss.backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    # what is live then beyond the parameters (the gradients come after the peak)
    measured = _live_peak(tmp_path / "trace.json")
    expected = estimate_memory(cfg).activations
    assert measured == pytest.approx(expected, rel=0.05)
    # and the loss path is most of it: the old count (bf16 logits, no backward) is far below
    assert expected - 6 * N * VOCAB < 0.6 * measured
