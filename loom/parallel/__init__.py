"""Applying parallelism to a plain model, from outside, in one documented order.

``parallelize`` is the only place where techniques are composed. The order (each step a short
``apply_x(model, its_group_or_mesh, its_knobs)`` in its own module) is the one TorchTitan settled
on, because each later step must see the module the earlier ones produced:

1. tensor / sequence / vocabulary parallelism on ``tp`` (``tensor.py``): parameters become
   DTensors sharded by heads, MLP columns/rows and vocabulary;
2. context parallelism on ``cp`` (``context.py``): the attention core is swapped for Ulysses,
   ring or hybrid attention over sequence shards (it sees the local heads left by step 1);
3. expert parallelism on ``ep`` (``expert.py``): each ep rank keeps E/ep experts of every MoE
   layer and tokens travel by all-to-all; the data-parallel step below then reduces only the
   dense parameters (expert gradients follow ``expert.reduce_gradients``' rule);
4. activation recomputation                      (not yet in this version)
5. data parallelism (``data.py``), always last: it must see the final (local) parameters. Its
   group is ``dp`` (dp_replicate x dp_shard x ep), or ``dp x cp`` when cp > 1, because cp ranks
   hold the same weights and average their gradients like replicas.

Pipeline parallelism is applied before all of these by splitting the model into stages
(``loom.pipeline``). Every step is the identity at degree 1.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from loom.parallel.comm import CommLedger
from loom.parallel.data import apply_data_parallel, finish_gradient_sync, no_gradient_sync, unwrap
from loom.topology import Meshes

__all__ = ["parallelize", "finish_gradient_sync", "no_gradient_sync", "unwrap"]


def parallelize(model: nn.Module, meshes: Meshes, parallel: Any, *, cp_groups: Any = None,
                ledger: CommLedger | None = None) -> nn.Module:
    """Apply every parallelism whose degree is > 1, in the order above.

    ``parallel`` is a ``ParallelConfig``; ``cp_groups`` the rank's ``context.CPGroups`` (made by
    the caller, because creating groups is collective) or None at cp = 1.
    """
    if parallel.tp > 1:
        from loom.parallel.tensor import apply_tensor_parallel

        model = apply_tensor_parallel(model, meshes.root["tp"],
                                      sequence_parallel=parallel.sequence_parallel,
                                      vocab_parallel=parallel.vocab_parallel, ledger=ledger)
    if parallel.cp > 1:
        from loom.parallel.context import apply_context_parallel

        model = apply_context_parallel(model, cp_groups, ledger)
    dp_mesh, axis = (meshes.dp_cp, "dp_cp") if parallel.cp > 1 else (meshes.dp, "dp")
    if parallel.ep > 1:
        from loom.parallel.data import GradientReducer
        from loom.parallel.expert import apply_expert_parallel, expert_parameter_names

        model = apply_expert_parallel(model, meshes.root["ep"].get_group(), ledger)
        experts = expert_parameter_names(model)
        dense = [p for n, p in model.named_parameters() if n not in experts]
        model._loom_grad_reducer = GradientReducer(dense, dp_mesh.get_group(), dp_mesh.size(),
                                                   ledger=ledger, axis=axis)
        return model
    return apply_data_parallel(model, dp_mesh.get_group(), dp_mesh.size(), ledger=ledger,
                               axis=axis)
