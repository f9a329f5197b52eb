"""Inference along one path of a model's stages (``loom.pipeline.path_inference``): every stage
is the model itself; leaving stages out is the model built with only the kept layers (seeded
by name, so the same weights); bad stage lists are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom.models import PRESETS, build_model, reset_parameters
from loom.pipeline.partition import partition_model
from loom.pipeline.path_inference import half_of_the_middle, path_forward, path_loss

ARGS = dataclasses.replace(PRESETS["debug"], n_layers=8)
SEED, SEQ = 3, 16


def _model(**kwargs):
    model = build_model(ARGS, device="meta", **kwargs)
    model.to_empty(device="cpu")
    reset_parameters(model, SEED)
    return model.eval()


def _batches():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 3, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def test_every_stage_is_the_whole_model():
    model, layers = _model(), partition_model(ARGS, 4, SEQ)
    x, y = _batches()[0]
    with torch.no_grad():
        assert torch.equal(path_forward(model, layers, [0, 1, 2, 3], x), model(x))
        expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert path_loss(model, layers, [0, 1, 2, 3], [(x, y)]) == pytest.approx(expected.item(),
                                                                           rel=1e-6)


@pytest.mark.parametrize("stages", [[0, 2, 3], [0, 1, 3], [0, 3], [0, 2, 1, 3]])
def test_leaving_stages_out_is_the_model_of_the_kept_layers(stages):
    model, layers = _model(), partition_model(ARGS, 4, SEQ)
    kept = [layer for s in stages for layer in layers[s]]
    x, _ = _batches()[0]
    with torch.no_grad():
        got = path_forward(model, layers, stages, x)
        if sorted(kept) == kept:  # in model order: a model holding only those layers
            torch.testing.assert_close(got, _model(layer_ids=kept)(x), rtol=0, atol=0)
        else:  # a swap: by hand, layer by layer in the path's order
            h = model.tok_embeddings(x)
            for layer in kept:
                h = model.layers[str(layer)](h, model.rope_cos[:SEQ], model.rope_sin[:SEQ])
            torch.testing.assert_close(got, model.output(model.norm(h)), rtol=0, atol=0)
    assert path_loss(model, layers, stages, _batches()) != path_loss(model, layers,
                                                                     [0, 1, 2, 3], _batches())


@pytest.mark.parametrize("stages, words", [
    ([1, 2, 3], "starts at stage 0"), ([0, 1, 2], "ends at the last stage, 3"),
    ([0, 1, 1, 3], "at most once"), ([0, 5, 3], "at most once"), ([], "starts at stage 0")])
def test_bad_stage_lists_are_refused_by_name(stages, words):
    model, layers = _model(), partition_model(ARGS, 4, SEQ)
    with pytest.raises(ValueError, match=words):
        path_forward(model, layers, stages, _batches()[0][0])


def test_half_of_the_middle():
    assert half_of_the_middle(4) == [[0, 2, 3], [0, 1, 3]]
    assert len(half_of_the_middle(6)) == 6 and all(len(p) == 4 for p in half_of_the_middle(6))
    assert half_of_the_middle(2) == [[0, 1]]
