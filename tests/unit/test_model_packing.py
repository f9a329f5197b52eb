"""Specification of document-masked attention: a packed batch through the model equals running
every document (every piece of a split one) on its own, in logits and in every gradient, with
the loss the mean over real tokens; the unmasked model is unchanged.

Everything runs the ``debug`` shape (64 wide, 4 layers, 4 query and 2 key/value heads) in fp32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loom.data.packing import IGNORE_INDEX, PAD_DOCUMENT, DocumentBatch, PackedDocuments, \
    offsets_from_eos
from loom.models import DocumentMask, Transformer, TransformerArgs, build_model, preset, \
    reset_parameters
from loom.models.document_attention import flex_length

torch.set_num_threads(1)

SEQ = 24
EOS = 300
# Token lengths with the end of document: short ones, one exactly a row (25 tokens: 24
# predictions) and one longer than two rows.
LENGTHS = [7, 12, 25, 3, 60, 9, 2, 14, 30]
ATOL = 1e-5


def make(**changes) -> Transformer:
    model = build_model(dataclasses.replace(preset("debug"), **changes), device="cpu")
    reset_parameters(model, seed=3)
    return model


def packed_rows(args: TransformerArgs, seed: int = 0) -> DocumentBatch:
    """Every row of the documents of ``LENGTHS`` (random ids, ``EOS`` last), packed."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, EOS, n - 1), EOS) for n in LENGTHS]
    tokens = np.concatenate(docs)
    ds = PackedDocuments(tokens, offsets_from_eos(tokens, EOS), SEQ)
    return ds.batch(range(len(ds)))


def pieces(rows: DocumentBatch) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document piece (padding left out)."""
    out = []
    for b, ids in enumerate(rows.document_ids.tolist()):
        start = 0
        for s in range(1, SEQ + 1):
            if s == SEQ or ids[s] != ids[start]:
                if ids[start] != PAD_DOCUMENT:
                    out.append((b, start, s))
                start = s
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("changes", [
    {},
    {"sliding_window": 5},  # Mistral's window inside each document
    {"qk_norm": True, "qkv_bias": True, "tie_embeddings": True},
])
def test_packed_rows_equal_each_document_run_alone(changes):
    model = make(**changes)
    rows = packed_rows(model.args)
    assert (rows.targets == IGNORE_INDEX).any() and len(rows.inputs) >= 6

    logits = model(rows.inputs, positions=rows.positions, document_ids=rows.document_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), rows.targets.flatten())  # mean of real tokens
    loss.backward()
    packed_grads = grads(model)

    model.zero_grad()
    n_real = int((rows.targets != IGNORE_INDEX).sum())
    reference = torch.zeros(())
    for b, start, end in pieces(rows):
        alone = model(rows.inputs[b:b + 1, start:end])  # the plain model on one document
        assert torch.allclose(logits[b, start:end], alone[0], atol=ATOL, rtol=0)
        reference = reference + F.cross_entropy(alone[0], rows.targets[b, start:end],
                                                reduction="sum")
    (reference / n_real).backward()

    assert torch.allclose(loss, reference / n_real, atol=ATOL, rtol=0)
    for name, grad in grads(model).items():
        assert torch.allclose(packed_grads[name], grad, atol=ATOL, rtol=0), name


def test_a_document_longer_than_a_row_is_split_into_pieces_that_restart_at_zero():
    rows = packed_rows(preset("debug"))
    long_doc = LENGTHS.index(60)
    spans = [(b, s, e) for b, s, e in pieces(rows) if rows.document_ids[b, s] == long_doc]
    assert len(spans) >= 3 and sum(e - s for _, s, e in spans) == 59
    assert all(rows.positions[b, s] == 0 for b, s, _ in spans)


def test_positions_are_derived_from_the_document_ids_when_not_given():
    model = make()
    rows = packed_rows(model.args)
    given = model(rows.inputs, positions=rows.positions, document_ids=rows.document_ids)
    derived = model(rows.inputs, document_ids=rows.document_ids)
    assert torch.equal(given, derived)


def test_a_row_that_is_one_document_is_the_plain_model_bit_for_bit():
    model = make()
    tokens = torch.randint(0, 300, (3, SEQ), generator=torch.Generator().manual_seed(1))
    one_document = torch.zeros(3, SEQ, dtype=torch.int64)
    assert torch.equal(model(tokens, document_ids=one_document), model(tokens))


@pytest.mark.parametrize("window", [0, 5])
def test_the_flex_kernel_masks_as_the_segments_kernel_does(window):
    """FlexAttention (the CUDA path) runs forward only on the CPU: its block mask is checked
    here against the per-document SDPA the CPU trains with."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0] * 50 + [1] * 30 + [2] * 48, [5] * 128, [0] * 3 + [1] * 125])
    q = torch.randn(3, 4, 128, 16, generator=generator)
    k, v = (torch.randn(3, 2, 128, 16, generator=generator) for _ in range(2))
    mask = DocumentMask(ids)
    flex = mask.attention(q, k, v, window, kernel="flex")
    segments = mask.attention(q, k, v, window, kernel="segments")
    assert torch.allclose(flex, segments, atol=ATOL, rtol=0)


def test_neighbouring_runs_of_equal_ids_are_one_document_and_distinct_ones_two():
    mask = DocumentMask(torch.tensor([[4, 4, 7, 7, 4, PAD_DOCUMENT]]))
    assert mask.positions().tolist() == [[0, 1, 0, 1, 0, 0]]
    assert [(s, e) for s, e, _ in mask.spans] == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_a_core_swapped_from_outside_is_refused_with_document_ids():
    model = make()
    for layer in model.layers.values():
        layer.attention.core = lambda q, k, v: q  # what a context-parallel core would be
    with pytest.raises(ValueError, match="runs on one device only"):
        model(torch.zeros(1, 8, dtype=torch.int64),
              document_ids=torch.zeros(1, 8, dtype=torch.int64))


def test_mismatched_document_ids_are_refused():
    model = make()
    with pytest.raises(ValueError, match="does not match"):
        model(torch.zeros(2, 8, dtype=torch.int64),
              document_ids=torch.zeros(2, 6, dtype=torch.int64))


def test_the_flex_kernel_pads_a_varlen_row_to_a_power_of_two_and_masks_the_padding():
    """Varlen rows ``[1, T]`` (a new T almost every microbatch) run the compiled flex kernel at
    a few lengths: T = 100 runs at 128, 300 at 512, with the padding fully masked."""
    assert [flex_length(n) for n in (1, 100, 128, 129, 300, 2048)] == [128, 128, 128, 256, 512,
                                                                        2048]
    generator = torch.Generator().manual_seed(1)
    for length in (100, 300):
        ids = torch.repeat_interleave(torch.arange(5), length // 5)[None]
        q = torch.randn(1, 4, length, 16, generator=generator)
        k, v = (torch.randn(1, 2, length, 16, generator=generator) for _ in range(2))
        mask = DocumentMask(ids)
        flex = mask.attention(q, k, v, 0, kernel="flex")
        assert flex.shape == q.shape
        assert torch.allclose(flex, mask.attention(q, k, v, 0, kernel="segments"), atol=ATOL,
                              rtol=0)


def test_selective_recompute_runs_the_document_attention_again_in_backward(monkeypatch):
    """``train.recompute = selective`` wraps the document-masked core as it wraps the plain
    one: each layer's document attention runs once in forward and once more in backward, and
    the gradients are those of the unwrapped model."""
    from loom.parallel.activation import apply_activation_checkpointing

    rows = packed_rows(preset("debug"))
    plain, wrapped = make(), apply_activation_checkpointing(make(), "selective")
    calls = []
    attention = DocumentMask.attention
    monkeypatch.setattr(DocumentMask, "attention",
                        lambda self, *a, **k: calls.append(1) or attention(self, *a, **k))
    for model in (plain, wrapped):
        logits = model(rows.inputs, positions=rows.positions, document_ids=rows.document_ids)
        F.cross_entropy(logits.flatten(0, 1), rows.targets.flatten()).backward()
    layers = len(plain.layers)
    assert len(calls) == layers + 2 * layers  # plain: forward only; selective: and backward
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
