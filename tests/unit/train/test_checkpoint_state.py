"""``flat_range_boxes``: a run of row-major elements is cut into boxes that are contiguous views,
in order, covering exactly that run (what ZeRO-1/2 checkpoints rely on)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from loom.train.checkpoint_state import flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), ()])
def test_boxes_cover_the_range_in_order_as_contiguous_views(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        seen = []
        for offsets, sizes in boxes:
            piece = index[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            assert piece.shape == torch.Size(sizes)
            flat = piece.reshape(-1)
            # contiguous in the parent: consecutive row-major indices
            assert torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel()))
            seen.append(flat)
        assert torch.equal(torch.cat(seen), torch.arange(start, stop)), (shape, start, stop)


def test_an_empty_range_has_no_boxes():
    assert flat_range_boxes((3, 4), 5, 5) == []
