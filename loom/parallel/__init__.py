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
4. activation recomputation (``activation.py``, ``train.recompute``): blocks wrapped in place;
   under SP the blocks it leaves whole keep their linears' gathered inputs sharded
   (``sequence_saved.py``: saved as the rank's slice, all-gathered again in backward);
   then ``torch.compile`` of each block (``compile.py``, ``train.compile``), as TorchTitan
   does: after TP and recomputation (it traces what they made), before FSDP2 (whose hooks then
   stay outside the compiled graph);
5. data parallelism (``data.py``), always last: it must see the final (local) parameters. Its
   group is ``dp`` (dp_replicate x dp_shard x ep), or ``dp x cp`` when cp > 1, because cp ranks
   hold the same weights and average their gradients like replicas. With ``dp_shard > 1`` it is
   ZeRO instead: stage 3 through FSDP2 (``data.apply_fully_shard``), 1 and 2 ``zero.py``'s.
   With ep > 1 ZeRO shards the dense weights over ``dp_shard x ep`` and each ep rank's experts
   over ``dp_shard`` (``expert_zero_mesh``; both x cp under cp), dividing both by dp x ep (x cp).
   Under an outer-loop ``dp_mode`` (DiLoCo, NoLoCo, CO2) the groups leave ``dp_replicate`` out:
   each replica reduces inside itself, and ``loom.parallel.outer`` merges the replicas' weights.
   ``train.dtype = bf16`` (bf16 parameters, fp32 masters) is applied here too, because each
   data-parallel form keeps the masters its own way: FSDP2's ``MixedPrecisionPolicy`` over
   sharded fp32 parameters (ZeRO-3), fp32 slices of the flat buckets (ZeRO-1/2, ``zero.py``),
   or ``mixed_precision.apply_bf16_parameters`` before the reducer's hooks (no ZeRO).

Before all of these, ``train.fp8`` converts the blocks' linear layers to torchao's
``Float8Linear`` (``fp8.py``): the wrappers then see FP8 matmuls in place of the plain ones.

Pipeline parallelism is applied before all of these by splitting the model into stages
(``loom.pipeline``); ``loom.pipeline.runtime.build_pipeline`` then calls ``parallelize`` on every
stage module, and the runtime decides when each stage's gradients are reduced (during its last
backward piece of the step when that is a full backward, else right after it). Under pp > 1, ZeRO-3 with ``reshard_after_forward = false`` keeps a
stage's parameters gathered across the whole step (one all-gather per step, not per microbatch).
Every step is the identity at degree 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.layout import Job, Layout
from loom.parallel.activation import apply_activation_checkpointing, recomputed_layers
from loom.parallel.comm import CommLedger
from loom.parallel.compile import apply_compile
from loom.parallel.context import apply_context_parallel
from loom.parallel.data import GradientReducer, apply_fully_shard
from loom.parallel.expert import ExpertParallel, apply_expert_parallel, expert_parameter_names
from loom.parallel.fp8 import apply_fp8
from loom.parallel.mixed_precision import apply_bf16_parameters
from loom.parallel.sequence_saved import keep_saved_inputs_sharded
from loom.parallel.tensor import TensorParallel, apply_tensor_parallel
from loom.parallel.zero import apply_zero
from loom.topology import Meshes

__all__ = ["parallelize", "Parallelized"]


def zero_mesh(meshes: Meshes, parallel: Layout, across_replicas: bool = True
              ) -> tuple[Any, str]:
    """ZeRO's mesh and its ledger axis name: ``dp_shard``, or ``dp_shard x cp`` flattened when
    cp > 1 (cp ranks hold the same weights, so they shard them too, and their gradients are
    averaged with the data-parallel ones); 2-D with ``dp_replicate`` first for HSDP, unless
    ``across_replicas`` is False (an outer loop merges the replicas: the 1-D shard mesh)."""
    hsdp = parallel.dp_replicate > 1 and across_replicas
    if parallel.ep > 1:  # dense weights are replicated over ep too: they shard over it (and cp)
        return (meshes.dense_2d if hsdp else meshes.dp_shard_ep), \
            "dp_shard_ep_cp" if parallel.cp > 1 else "dp_shard_ep"
    if parallel.cp > 1:
        mesh = meshes.shard_2d if hsdp else meshes.dp_shard_cp
        return mesh, "dp_shard_cp"
    if hsdp:
        return meshes.root[("dp_replicate", "dp_shard")], "dp_shard"
    return meshes.root["dp_shard"], "dp_shard"


def expert_zero_mesh(meshes: Meshes, parallel: Layout, ndim: int) -> tuple[Any, str] | None:
    """With ep > 1, the mesh ZeRO shards the expert weights over and its ledger name (None
    otherwise): ``dp_shard``, or ``dp_shard x cp`` flattened, the ranks holding the same experts
    (``ndim`` 2 under HSDP: ``(dp_replicate, ...)``, as FSDP2 wants; ZeRO-1/2 take the 1-D
    shard mesh and average over dp_replicate themselves)."""
    if parallel.ep == 1:
        return None
    two_d = ndim == 2 and parallel.dp_replicate > 1
    if parallel.cp > 1:
        return (meshes.shard_2d if two_d else meshes.dp_shard_cp), "dp_shard_cp"
    return meshes.root[("dp_replicate", "dp_shard")] if two_d else meshes.root["dp_shard"], \
        "dp_shard"


@dataclass(frozen=True)
class Parallelized:
    """What ``parallelize`` applied: the module to train and the records of each parallelism
    (None where its degree is 1), which the trainer, the pipeline runtime, clipping and
    checkpoints use instead of looking them up on the module."""

    module: nn.Module
    tensor: TensorParallel | None = None  # tp: mesh, sequence / vocabulary parallelism
    experts: ExpertParallel | None = None  # ep: group and rank of the expert shards
    # who reduces the gradients: a data-parallel ``GradientReducer``, ZeRO-1/2's sharded
    # optimizer or ZeRO-3's sync (None: one data-parallel rank)
    reducer: Any = None


def parallelize(model: nn.Module, meshes: Meshes, job: Job, *, cp_groups: Any = None,
                ledger: CommLedger | None = None) -> Parallelized:
    """Apply every parallelism whose degree is > 1, in the order above; returns the module and
    the record of what was applied (nothing is left on the module for others to look up).

    ``job`` gives the layout (degrees and knobs), the compute and gradient-reduction dtypes and
    the optimizer's offload; ``cp_groups`` is the rank's ``context.CPGroups`` (made by the
    caller, because creating groups is collective) or None at cp = 1.
    """
    parallel = job.layout
    tensor = experts = None
    apply_fp8(model, job.fp8, emulate=job.fp8_emulate,  # first: every wrapper sees Float8Linear
              fsdp_float8_all_gather=job.fp8_all_gather)
    if parallel.tp > 1:
        model = apply_tensor_parallel(model, meshes.root["tp"],
                                      sequence_parallel=parallel.sequence_parallel,
                                      vocab_parallel=parallel.vocab_parallel, ledger=ledger)
        tensor = TensorParallel(meshes.root["tp"], parallel.sequence_parallel,
                                parallel.vocab_parallel, ledger)
    if parallel.cp > 1 or cp_groups is not None:  # or zeppelin's dp x cp domain at cp = 1
        model = apply_context_parallel(model, cp_groups, ledger)
    if parallel.ep > 1:
        experts = apply_expert_parallel(model, meshes.root["ep"].get_group(), ledger)
    if parallel.recompute != "none":
        model = apply_activation_checkpointing(model, parallel.recompute, parallel.recompute_every)
    if parallel.tp > 1 and parallel.sequence_parallel and not job.compile:
        layers = getattr(model, "layers", {})
        full = set(recomputed_layers([int(k) for k in layers], parallel.recompute,
                                     parallel.recompute_every))
        keep_saved_inputs_sharded([b for k, b in layers.items() if int(k) not in full],
                                  meshes.root["tp"], ledger)
    if job.compile:
        model = apply_compile(model, documents=job.packing != "concat",
                              dynamic=job.packing == "varlen")
    return Parallelized(model, tensor, experts,
                        _data_parallel(model, meshes, job, ledger, experts))


def _tied_ends(model: nn.Module) -> dict[str, str]:
    """A tied model's embedding or head weight as a pipeline stage holds it (both are one
    Parameter where one module holds both ends), by its name in ``model`` -> its global name
    (the embedding's, as ``LocalStages`` and checkpoints name a tied head): ZeRO-1/2 buckets it
    alone under that name, so the two stages' copies are sliced alike, the pipeline's tie sum
    adds their reduced slices (``loom.pipeline.runtime``) and the optimizer state has one key."""
    args = getattr(model, "args", None)
    if args is None or not args.tie_embeddings:
        return {}
    names = {name for name, _ in model.named_parameters()}
    return {n: "tok_embeddings.weight" for n in ("tok_embeddings.weight", "output.weight")
            if n in names}


def _data_parallel(model: nn.Module, meshes: Meshes, job: Job, ledger: CommLedger | None,
                   experts: ExpertParallel | None) -> Any:
    """The reducer of ``model``'s gradients over the data axes (ZeRO-3 shards ``model`` in
    place first); None at data-parallel degree 1."""
    parallel = job.layout
    reduce_dtype = torch.bfloat16 if job.grad_reduce_dtype == "bf16" else torch.float32
    bucket_bytes = int(job.grad_bucket_mb * 2**20)
    # An outer loop (job.dp_mode != sync, loom.parallel.outer) merges the dp_replicate replicas'
    # weights itself: gradients are averaged inside a replica only (dp_shard, ep, cp), and
    # ZeRO's meshes are the replica's own (1-D: no HSDP dimension across replicas), the
    # experts' too.
    across_replicas = job.dp_mode == "sync"
    if parallel.zero_stage == 3:
        mesh, axis = zero_mesh(meshes, parallel, across_replicas)
        # bf16 (and bf16 autocast): FSDP2 gathers bf16 copies of its sharded fp32 parameters,
        # which are the master weights the optimizer steps
        compute = torch.bfloat16 if job.dtype in ("bf16", "bf16_autocast") else None
        # Under a pipeline, reshard_after_forward = false means "gathered across the step":
        # the runtime reshards after the stage's last backward piece, FSDP2 never by itself.
        after_backward = parallel.pp == 1 or parallel.reshard_after_forward
        return apply_fully_shard(model, mesh, reshard_after_forward=parallel.reshard_after_forward,
                                 reshard_after_backward=after_backward, param_dtype=compute,
                                 reduce_dtype=reduce_dtype, offload_optimizer=job.offload_optimizer,
                                 ledger=ledger, axis=axis,
                                 experts=expert_zero_mesh(meshes, parallel,
                                                          2 if across_replicas else 1),
                                 cast_forward_inputs=job.dtype != "bf16")
    if parallel.zero_stage:
        mesh, axis = zero_mesh(meshes, parallel)
        shard_mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim == 2 else mesh
        # an outer mode: the slices are averaged inside the replica only (the outer loop
        # merges the replicas' slices, ``Trainer._outer_loop``)
        replicate = meshes.root["dp_replicate"] if across_replicas else None
        return apply_zero(model, parallel.zero_stage, shard_mesh, replicate,
                          axis=axis, reduce_dtype=reduce_dtype, offload=job.offload_optimizer,
                          ledger=ledger, bucket_bytes=bucket_bytes,
                          tp_group=meshes.root["tp"].get_group() if parallel.tp > 1 else None,
                          experts=expert_zero_mesh(meshes, parallel, 1),
                          ep_size=experts.size if experts is not None else 1,
                          param_dtype=torch.bfloat16 if job.dtype == "bf16" else torch.float32,
                          alone=_tied_ends(model))
    if job.dtype == "bf16":  # bf16 parameters, fp32 masters, before any reducer's hooks
        apply_bf16_parameters(model, reduce_dtype)
    dp_mesh, axis = (meshes.dp_cp, "dp_cp") if parallel.cp > 1 else (meshes.dp, "dp")
    if not across_replicas:  # dp_shard = 1 here (else ZeRO): a replica's ep and cp ranks
        dp_mesh, axis = (meshes.replica, "replica") if parallel.ep > 1 else (meshes.root["cp"],
                                                                            "cp")
    params = list(model.parameters())
    if experts is not None:  # the dense ones: expert gradients follow reduce_gradients' rule
        names = expert_parameter_names(model)
        params = [p for n, p in model.named_parameters() if n not in names]
    if dp_mesh.size() == 1:
        return None
    return GradientReducer(params, dp_mesh.get_group(), dp_mesh.size(), ledger=ledger, axis=axis,
                           reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes,
                           compression=job.compression, seed=job.seed)
