"""Counting the collectives that torch issues on Loom's behalf (DTensor), into the same ledger.

Loom's own collectives go through ``loom.parallel.comm`` and are counted there. Collectives that
DTensor issues (tensor and sequence parallelism) are desugared by DTensor into torch's functional
collectives (``torch.ops._c10d_functional.*``) and never pass through ``comm.py``. The one place
they are counted is ``CollectiveCounter``, a ``TorchDispatchMode``:

* it returns ``NotImplemented`` for an op on DTensors, so DTensor runs first and its collectives
  reach the mode as plain functional-collective ops (the trick torch's ``CommDebugMode`` uses);
* it maps each op's process-group name to a Loom axis name (``{"tp": tp_mesh}``) and records one
  call with the same payload / wire-byte convention as ``comm.py`` (all-gather: the gathered
  output; reduce-scatter: the full input; all-reduce: the tensor);
* it must be active around the forward *and* the ``backward()`` call: the autograd engine restores
  the dispatch-mode stack that was current when ``backward()`` started, so a mode entered inside a
  backward node would not survive to the next node. ``tests/dist/test_tensor_parallel.py`` checks
  that backward collectives are seen.

Collectives on groups that are not in the map, by name or by member ranks, are recorded under
axis ``"?"`` so nothing is lost silently. ``c10d.*`` (in-place, non-functional) ops are not
counted here: those are the ones ``comm.py`` issues and already counted. The mode costs one Python call per dispatched op, so it
is for measurement steps and tests, not every production step.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from loom.parallel.comm import CommLedger

_F = torch.ops._c10d_functional
# op packet -> (Loom op name, index of the group-name argument, payload factor(n) on the input)
_OPS: dict[Any, tuple[str, int, Any]] = {
    _F.all_reduce: ("all_reduce", 2, lambda n: 1),
    _F.all_gather_into_tensor: ("all_gather", 2, lambda n: n),  # payload is the gathered output
    _F.reduce_scatter_tensor: ("reduce_scatter", 3, lambda n: 1),
    _F.all_to_all_single: ("all_to_all", 3, lambda n: 1),
    _F.broadcast: ("broadcast", 2, lambda n: 1),
}
_WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
         "broadcast": lambda n: (n - 1) / n}


class CollectiveCounter(TorchDispatchMode):
    """Record every functional collective issued while active into ``ledger``, by axis name."""

    def __init__(self, ledger: CommLedger, axes: Mapping[str, DeviceMesh]) -> None:
        super().__init__()
        self.ledger = ledger
        # group name -> (axis, group size); only 1-D meshes name a single group
        self.groups = {mesh.get_group().group_name: (axis, mesh.size()) for axis, mesh in axes.items()}
        # ... and by member ranks: DTensor's sharding cache can hand back an equal mesh built
        # earlier in the process, whose group has another name but the same ranks.
        self.by_ranks = {tuple(torch.distributed.get_process_group_ranks(mesh.get_group())):
                         (axis, mesh.size()) for axis, mesh in axes.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain collectives first
        out = func(*args, **kwargs)
        spec = _OPS.get(func._overloadpacket)
        if spec is not None:
            op, group_index, payload_factor = spec
            group_name = args[group_index] if len(args) > group_index else kwargs.get("group_name")
            axis, n = self.groups.get(group_name, ("?", 0))
            if n == 0:  # another name: known by its ranks, else size from the collective itself
                group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
                ranks = tuple(torch.distributed.get_process_group_ranks(group))
                axis, n = self.by_ranks.get(ranks, ("?", group.size()))
            tensor = args[0]
            payload = tensor.numel() * tensor.element_size() * payload_factor(n)
            self.ledger.add(axis, op, payload, _WIRE[op](n) * payload)
        return out
