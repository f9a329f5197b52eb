"""The one place Loom's own collectives go through, so every byte can be counted per axis and op.

Each function wraps the ``torch.distributed`` call of the same name and, when given a
``CommLedger``, records one call and its bytes under ``(axis, op)``. Two byte counts are kept:

* ``payload``: the size of the tensor handed to the collective (for all-gather: the gathered
  output; for reduce-scatter: the full input), i.e. the message size M of the papers;
* ``wire``: what one rank sends with the bandwidth-optimal (ring / pairwise) algorithm, the
  quantity the communication formulas of Megatron, ZeRO and Ulysses count:

  ==================  ===================  ==========================================
  op                  wire bytes per rank  source
  ==================  ===================  ==========================================
  all_reduce          2 (n-1)/n * M        reduce-scatter + all-gather (ZeRO §7, USP Table 2)
  all_gather          (n-1)/n * M_out      ring
  reduce_scatter      (n-1)/n * M_in       ring
  all_to_all          (n-1)/n * M          each rank keeps 1/n of its own data
  send / recv         M / 0                point-to-point (counted at the sender)
  ==================  ===================  ==========================================

The ledger is a plain object owned by whoever runs the step (the trainer) and passed explicitly to
the parallel wrappers; there is no global counter. Counting is a few Python additions per call.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommRecord:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CommLedger:
    """Calls and bytes per ``(axis, op)``; ``reset()`` between steps, ``summary()`` to log."""

    records: dict[tuple[str, str], CommRecord] = field(
        default_factory=lambda: defaultdict(CommRecord))

    def add(self, axis: str, op: str, payload_bytes: int, wire_bytes: float) -> None:
        record = self.records[(axis, op)]
        record.calls += 1
        record.payload_bytes += payload_bytes
        record.wire_bytes += wire_bytes

    def reset(self) -> None:
        self.records.clear()

    def get(self, axis: str, op: str) -> CommRecord:
        return self.records.get((axis, op), CommRecord())

    def summary(self) -> dict[str, float]:
        """Flat metrics, e.g. ``comm/tp/all_reduce/wire_bytes``, for the metrics logger."""
        out: dict[str, float] = {}
        for (axis, op), record in sorted(self.records.items()):
            prefix = f"comm/{axis}/{op}"
            out[f"{prefix}/calls"] = record.calls
            out[f"{prefix}/payload_bytes"] = record.payload_bytes
            out[f"{prefix}/wire_bytes"] = record.wire_bytes
        return out


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a (possibly DTensor) tensor."""
    return getattr(tensor, "_local_tensor", tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _record(ledger: CommLedger | None, axis: str, op: str, payload: int, group: Any,
            wire_factor) -> None:
    if ledger is not None:
        n = dist.get_world_size(group)
        ledger.add(axis, op, payload, wire_factor(n) * payload)


def all_reduce(tensor: torch.Tensor, group: Any, *, axis: str, ledger: CommLedger | None = None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False):
    _record(ledger, axis, "all_reduce", _nbytes(tensor), group, lambda n: 2 * (n - 1) / n)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group: Any, *, axis: str,
                           ledger: CommLedger | None = None, async_op: bool = False):
    _record(ledger, axis, "all_gather", _nbytes(output), group, lambda n: (n - 1) / n)
    # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning in every run) for this name
    return dist.all_gather_single(output, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, group: Any, *, axis: str,
                          ledger: CommLedger | None = None,
                          op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                          async_op: bool = False):
    _record(ledger, axis, "reduce_scatter", _nbytes(tensor), group, lambda n: (n - 1) / n)
    # torch 2.13 deprecates reduce_scatter_tensor (a FutureWarning in every run) for this name
    return dist.reduce_scatter_single(output, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, group: Any, *, axis: str,
                      ledger: CommLedger | None = None, async_op: bool = False,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None):
    """Equal splits of dim 0 unless split sizes are given (rows per peer, as in torch). With
    uneven splits the wire bytes are exact: the input minus the rows this rank keeps."""
    if input_split_sizes is None:
        _record(ledger, axis, "all_to_all", _nbytes(tensor), group, lambda n: (n - 1) / n)
    elif ledger is not None:
        kept = input_split_sizes[dist.get_rank(group)] * _nbytes(tensor[:1])  # 0 if empty
        ledger.add(axis, "all_to_all", _nbytes(tensor), float(_nbytes(tensor) - kept))
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group,
                                  async_op=async_op)


def isend(tensor: torch.Tensor, dst: int, group: Any, *, axis: str,
          ledger: CommLedger | None = None, tag: int = 0):
    """``dst`` is a global rank (as in ``torch.distributed``)."""
    if ledger is not None:
        ledger.add(axis, "send", _nbytes(tensor), _nbytes(tensor))
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, group: Any, *, axis: str,
          ledger: CommLedger | None = None, tag: int = 0):
    if ledger is not None:
        ledger.add(axis, "recv", _nbytes(tensor), 0.0)
    return dist.irecv(tensor, src=src, group=group, tag=tag)
