"""The remapping layer: a step's tokens moved between the attention layout and an equal split.

Zeppelin's partition (``loom.data.zeppelin``) places each sequence whole on one rank or on a
sub-ring of ranks, so that the *attention* work (~ s²) is balanced; the ranks then hold unequal
numbers of tokens, and the *linear* modules (~ tokens) would be as unequal. ``Remap`` moves the
rows of a ``[T_local, H]`` tensor from the attention layout (rank p holds the step's global
token indices ``attention_indices[p]``, in that order) to the linear layout (an equal split:
the planner's ``Partition.linear_layout``, which moves only each rank's surplus, or by default
the global range ``[p·T/R, (p+1)·T/R)``) with one all-to-all, and back with another.

Each direction is gather-by-destination, one ``all_to_all_single`` with uneven splits, and a
permutation into the receiver's order. The permutations are ordinary indexing (autograd
differentiates them); the all-to-all is an autograd ``Function`` whose backward is the
all-to-all with the splits swapped. So ``to_attention(to_linear(x)) == x`` exactly, forward and
backward, and a function of the remapped tokens gets the gradients it gets on one process
(``tests/dist/test_remap.py``). Every rank computes the same plan from the placement, which
the planner makes deterministically on every rank: nothing but the rows is communicated.

The collectives go through ``loom.parallel.comm`` (axis ``remap`` by default), so a
``CommLedger`` counts their calls and exact wire bytes (the rows that leave the rank).
In training (``data.zeppelin_remap``) ``loom.parallel.zeppelin_cp`` builds one plan per
microbatch (``sub_ring_keys``) and moves each attention layer's q, k, v and output with it.
A ``Remap`` moves rows whatever the rest of a row holds, so tp and pp need nothing here: the
group is the placement domain of the rank's own (tp, pp) coordinate, every tp rank plans the
same rows and moves its shard of the heads, and each stage remaps in its own layers.
Hand-written because torch has no uneven all-to-all with autograd (``torch.distributed
.nn.functional.all_to_all_single`` exists but bypasses Loom's ledger).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from loom.parallel import comm


class _AllToAll(torch.autograd.Function):
    """Rows ``send[q]`` of the input go to rank q; ``recv[p]`` rows come from rank p."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, send: tuple[int, ...],
                recv: tuple[int, ...], axis: str, ledger: comm.CommLedger | None) -> torch.Tensor:
        ctx.args = (group, send, recv, axis, ledger)
        return _exchange(x, group, send, recv, axis, ledger)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        group, send, recv, axis, ledger = ctx.args
        return _exchange(grad.contiguous(), group, recv, send, axis, ledger), None, None, None, \
            None, None


def _exchange(x: torch.Tensor, group: Any, send: tuple[int, ...], recv: tuple[int, ...],
              axis: str, ledger: comm.CommLedger | None) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), group, axis=axis, ledger=ledger,
                           output_split_sizes=list(recv), input_split_sizes=list(send))
    return out


def equal_bounds(total: int, ranks: int) -> np.ndarray:
    """``ranks + 1`` boundaries of the equal split of ``total`` tokens in global order."""
    return np.array([p * total // ranks for p in range(ranks + 1)], dtype=np.int64)


@dataclass(frozen=True)
class Remap:
    """One rank's plan of both directions (``build_remap``); ``group`` is passed explicitly."""

    send_order: np.ndarray  # local attention rows, grouped by destination rank
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_order: np.ndarray  # received rows -> the linear range's order
    group: Any
    axis: str = "remap"
    ledger: comm.CommLedger | None = None

    def to_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``[T_attention, ...]`` in attention layout -> ``[T_linear, ...]``, the rank's equal
        share in global order."""
        rows = x.index_select(0, torch.as_tensor(self.send_order, device=x.device))
        moved = _AllToAll.apply(rows, self.group, self.send_counts, self.recv_counts, self.axis,
                                self.ledger)
        return moved.index_select(0, torch.as_tensor(self.recv_order, device=x.device))

    def to_attention(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_linear``."""
        back = np.argsort(self.recv_order, kind="stable")
        rows = y.index_select(0, torch.as_tensor(back, device=y.device))
        moved = _AllToAll.apply(rows, self.group, self.recv_counts, self.send_counts, self.axis,
                                self.ledger)
        undo = np.argsort(self.send_order, kind="stable")
        return moved.index_select(0, torch.as_tensor(undo, device=y.device))


def build_remap(attention_indices: Sequence[Sequence[int] | np.ndarray], rank: int, group: Any,
                linear_indices: Sequence[Sequence[int] | np.ndarray] | None = None, *,
                axis: str = "remap", ledger: comm.CommLedger | None = None) -> Remap:
    """Rank ``rank``'s remapping between two layouts of the step's tokens, each given as every
    rank's global token indices in its order (p the rank in ``group``; each layout a
    permutation of ``0 .. T-1``): ``attention_indices`` (e.g. ``Partition.token_indices``) and
    ``linear_indices`` (e.g. ``Partition.linear_layout()``; None: the equal split in global
    order, ``equal_bounds``)."""
    ranks = len(attention_indices)
    source = [np.asarray(ix, dtype=np.int64) for ix in attention_indices]
    total = sum(len(ix) for ix in source)
    if linear_indices is None:
        bounds = equal_bounds(total, ranks)
        linear_indices = [np.arange(bounds[p], bounds[p + 1]) for p in range(ranks)]
    target = [np.asarray(ix, dtype=np.int64) for ix in linear_indices]
    for name, layout in (("attention_indices", source), ("linear_indices", target)):
        every = np.concatenate(layout) if layout else np.zeros(0, dtype=np.int64)
        if len(layout) != ranks or not np.array_equal(np.sort(every), np.arange(total)):
            raise ValueError(f"{name} must hold every token 0..{total - 1} exactly once over"
                             f" {ranks} ranks")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of the {ranks} ranks")
    owner = np.empty(total, dtype=np.int64)
    for q, ix in enumerate(target):
        owner[ix] = q
    dest = [owner[ix] for ix in source]
    send_order = np.argsort(dest[rank], kind="stable")
    send_counts = tuple(int(c) for c in np.bincount(dest[rank], minlength=ranks))
    incoming = [source[p][dest[p] == rank] for p in range(ranks)]  # in the sender's order
    recv_counts = tuple(len(part) for part in incoming)
    arrived = np.concatenate(incoming)
    by_index = np.argsort(arrived, kind="stable")
    recv_order = by_index[np.searchsorted(arrived[by_index], target[rank])]
    return Remap(send_order, send_counts, recv_counts, recv_order, group, axis, ledger)


__all__ = ["Remap", "build_remap", "equal_bounds"]
