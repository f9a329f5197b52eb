"""Vocabulary parallelism across pipeline stages (Yeung et al. 2024, arXiv 2411.05288): the input
embedding and the output layer with its loss split over the vocabulary onto every ``pp`` rank.

Without it the first pipeline rank holds the whole embedding and the last one the whole head, its
``[tokens, V]`` logits and the loss: for a large vocabulary both ends carry much more memory and
the last one much more compute than the middle. Here pipeline rank r of p holds rows
[rV/p, (r+1)V/p) of both (``VocabShard``; one Parameter when they are tied), and:

* input embedding, at the edges of the step (cheap: a lookup and its scatter): every rank looks up
  its rows for every microbatch, zero outside them (``embed``), and the first stage sums the p
  partial embeddings — exactly one is non-zero per token, so the sum is exact; after the
  schedule the first stage's input gradients go back to every rank, which scatters them into
  its rows (the same backward as a whole embedding's, restricted to them).
* output layer and loss, in two passes per microbatch that the schedule places
  (``loom.schedule.vocab_passes``; ``Op.S`` / ``Op.T``): the last stage's normalised output X
  goes to every rank; ``s_pass``: this shard's logits ``X W_r^T`` and their softmax statistics
  (row max, sum of exp of the shifted logits, the target's logit where the target is in the
  shard), sent to every rank; ``t_pass``: every shard's statistics combined in rank order into
  the global max, sum and target logit — the loss — then the shard's backward, its weight
  gradient and its part of dX, which the last stage sums before its own backward.

The loss formula is ``loom.parallel.vocab``'s (Megatron's vocab-parallel cross entropy on tp):
loss_i = log(sum_j exp(z_ij - max_i)) + max_i - z_i,target, gradient softmax - onehot, all in
fp32. What differs is where the statistics meet: tp all-reduces them inside one forward, while
over the pipeline they travel between two passes, so that no rank stalls for them; the combine
therefore rescales each shard's sum by exp(max_r - max) (``combine``). The loss reduction and
scaling stay the caller's: ``t_pass`` hands a ``ShardedLogits`` to the trainer's loss function,
and ``cross_entropy`` here reduces it as ``loom.parallel.vocab.cross_entropy`` reduces logits.

Precision: under ``train.dtype = bf16`` the rows are bf16 parameters with fp32 masters (the
runtime applies ``loom.parallel.mixed_precision`` to the shard as to a stage), under
``bf16_autocast`` S's matmul runs in the stages' autocast; either way a shard's logits are the
very bf16 values of its columns of one process's logits, upcast to fp32 before the statistics,
which travel and combine in fp32, and the runtime adds the p parts of dX in fp32 (under tp,
the tp sums below too).

Tensor parallelism (``parallel.tp`` = t > 1, Megatron's: the stages' blocks split over tp, their
residual stream replicated): the rows are split over all p·t ranks of a pipeline, pipeline
rank r and tp rank u holding shard r·t + u, rows [(r·t + u)V/(pt), (r·t + u + 1)V/(pt)):
pipeline-major, so the p pipeline blocks of rows are those of tp = 1, each split over tp as
Megatron splits a vocab-parallel head. Each weight is a DTensor ``Shard(0)`` on the ``tp`` mesh
of its pipeline rank's ``[V/p, D]`` block (``VocabRows`` records that block), so clipping sums
its squares over tp, and ``full_tensor``, checkpoints and pretrained loads place every tp rank's
rows as they do any tp-sharded weight. The point-to-point messages above run in each tp
slice's own pp group, unchanged (X, dX and the embedding's gradient are replicated over tp);
three tp collectives (axis ``tp_vocab`` in the ledger, fp32, per microbatch) join the t shards
of each pipeline rank:

* S: an all-gather of the ``[3, N]`` statistics over tp (payload 4·3·N·t bytes, on every rank),
  combined in tp order into the pipeline rank's ``[3, N]``, which travels over pp as before;
* the last stage: after summing the p parts of dX over pp, an all-reduce over tp (4·N·D bytes),
  so every tp rank of the last stage holds the whole dX its replicated output needs;
* the first stage: after summing the p partial embeddings over pp, an all-reduce over tp
  (4·N·D bytes), so every tp rank of the first stage gets the whole embedding (exact: one part
  is non-zero per token).

Sequence parallelism (``parallel.sequence_parallel`` with tp, Megatron's: the activations
between the stages' blocks sharded over the sequence on the tp ranks): every vocabulary message
over pp carries a tp rank's sequence shard ``[b, S/t, D]``, as the stages' own activations do,
and each pipeline rank converts with tp collectives (axis ``tp_vocab``, per microbatch,
N = b·S tokens, 4 bytes an element in fp32): the statistics' all-gather as above, the two
all-reduces become reduce-scatters on every rank, and two all-gathers join:

* S: X arrives as this tp rank's shard (the last stage sends its shard, ``loom.parallel.tensor``
  no longer gathers it for an Identity head) and is all-gathered over tp (payload 4·N·D, every
  rank): the S pass needs the whole sequence against its rows;
* T: this rank's part of dX ``[b, S, D]`` is reduce-scattered over tp (payload 4·N·D, every
  rank) into the sum over the t shards' rows of its sequence shard, which travels over pp;
  the last stage adds the p shards (no all-reduce: the sum is already over tp) and hands its
  blocks the sequence-sharded dX SP's backward expects;
* the embedding: every rank's partial embedding is reduce-scattered over tp (payload 4·N·D,
  every rank) before it travels; the first stage adds the p shards: its input, sequence-sharded;
* its gradient: the first stage's input gradient travels as the shard and every rank
  all-gathers it over tp (payload 4·N·D) before the backward through its rows.

Why convert at every pipeline rank rather than gather at the last stage and send whole
tensors: both move (p t - 1)·4·N·D bytes in all, but this way the pp messages (the slower
links, usually between nodes) are t times smaller and the tp collectives run on the fast tp
links of every rank in parallel, where gathering first puts t (p - 1) whole tensors on the
last stage's pp links. ``parallel.vocab_parallel`` (tp-only splitting of the head) is moot:
the stages hold no embedding or head to split.

Checkpoints: ``VocabRows`` records where its rows sit in the full ``[V, D]`` weight;
``row_slices`` hands that to ``loom.train.checkpoint_state``, which saves each rank's rows (and
their Adam moments) at that offset, so a checkpoint holds the whole embedding and head under
their names, as one process's does, and any layout loads it.

Data parallelism: the rows are reduced over the same data-parallel axes, in the same form, as
the stages' parameters (``data_parallel_rows``): plain data parallelism over ``dp`` (a
``GradientReducer``); ZeRO-1/2 on ``dp_shard`` (``loom.parallel.zero``: the shard's own sharded
optimizer, whose buckets the trainer steps and clips with the stages', ``of_stages``); ZeRO-3
(FSDP2 over ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP): the rows are sharded at rest
over dp_shard, 1/d of V/p rows a rank, and gathered by hand (``GatheredRows``), because the
shard has no forward for FSDP2's hooks: its passes are methods the runtime calls at schedule
positions of their own (the embedding at the step's start and its backward after the schedule,
S and T in between). So they are gathered once at the step's start, one all-gather of the V/p
rows over dp_shard (``(d-1)/d`` of them on the wire), held across the step as the stages are
under ``reshard_after_forward = false``, and after the embedding's backward reduce-scattered
once and freed: plain data parallelism's bytes per step whatever the stages'
``reshard_after_forward``, and the gathered rows (1/p of the embedding and head, 1/(p·t)
under tp) held for the whole step. Clipping then counts
each element once: the reduced slices' (ZeRO-1/2) or the DTensor shards' (ZeRO-3) squares over
dp_shard, over tp for tp shards, and over pp, whose ranks hold disjoint rows. Checkpoints write
each rank's slice of its rows at its offset in the full weight (the ZeRO-1/2 bucket boxes, the
FSDP2 DTensor's placement, shifted by the rows' start). Not composed: ep (config rules).

Context parallelism (``parallel.cp`` > 1, every ``cp_mode``): nothing here crosses cp. A cp rank
holds its part of every sequence (zig-zag under the ring, its targets cut with its tokens, its
positions only the stages' RoPE reads), and everything this module computes is per token: the
lookup, and each token's logits over the rows with their statistics, which meet over the rows'
owners, the pp ranks, never over other tokens. So each cp coordinate's pipeline (its pp group,
per tp slice) runs the passes and the embedding for its own N = b·S/cp tokens, exactly as
above, and only attention inside the stages talks over cp. What cp changes is the data axes:
the cp ranks hold the same rows and compute their gradients from other tokens, so the rows
are averaged over dp x cp as the stages' parameters are (``data_parallel_rows``: ``dp_cp``,
or ZeRO on dp_shard x cp), and the loss stays each cp rank's token mean (``cross_entropy``),
averaged with the others' by the trainer (equal shares under concatenated rows).

Hand-written because no library offers it: torch's pipelining and Megatron-Core keep the head
on the last stage; the paper's code patches Megatron-LM's schedules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from loom.data.packing import IGNORE_INDEX
from loom.layout import Job
from loom.models import TransformerArgs
from loom.models.llama import initial_value, seeded_name
from loom.parallel import comm, zero_mesh
from loom.parallel.comm import CommLedger
from loom.parallel.data import FullyShardedSync, GradientReducer, apply_fully_shard
from loom.parallel.mixed_precision import apply_bf16_parameters
from loom.parallel.vocab import cross_entropy as tensor_cross_entropy
from loom.parallel.zero import ZeroShardedOptimizer, apply_zero
from loom.topology import Meshes


class VocabRows(nn.Module):
    """Rows ``[start, start + rows)`` of a ``[total, D]`` weight, under the name ``weight`` (the
    full model's names). ``start`` and ``total`` are where they sit in the full weight: what a
    checkpoint needs to write them at their global offset (``row_slices``). Under tp the weight
    is a DTensor of those rows, ``Shard(0)`` over tp: its placement locates each tp rank's part
    within them, as for any tp-sharded weight."""

    def __init__(self, weight: nn.Parameter, start: int, total: int) -> None:
        super().__init__()
        self.weight = weight
        self.start, self.total = start, total


def row_slices(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name: (first row, rows of the full weight)}`` of every vocabulary shard's
    rows in ``model`` (a tied pair under both names), empty without vocabulary parallelism."""
    return {f"{name}.weight": (module.start, module.total)
            for name, module in model.named_modules() if isinstance(module, VocabRows)}


class VocabShard(nn.Module):
    """Pipeline rank ``shard`` of ``shards``' rows of the input embedding (``tok_embeddings``) and
    the output layer (``output``), initialised with those rows of the full model's seeded
    weights (bit-identical to one process's). Tied embeddings: one Parameter for both.

    ``tp`` (the ``tp`` mesh of this rank, degree t > 1): this rank holds shard
    ``shard * t + its tp rank`` of ``shards * t`` (the module docstring), as a DTensor
    ``Shard(0)`` of the pipeline rank's rows; its tp collectives are counted in ``ledger``.
    ``sequence_parallel`` (with tp): the pp messages are tp sequence shards (module docstring)."""

    def __init__(self, args: TransformerArgs, shard: int, shards: int,
                 device: torch.device | str, seed: int,
                 autocast: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext, tp: DeviceMesh | None = None,
                 ledger: CommLedger | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        # the stages' autocast (train.dtype = bf16_autocast): the head's matmul runs under it,
        # as the whole model's output layer does
        self.autocast = autocast
        self.tp = tp if tp is not None and tp.size() > 1 else None
        self.ledger = ledger
        self.sequence_parallel = self.tp is not None and sequence_parallel
        degree, tp_rank = (self.tp.size(), self.tp.get_local_rank()) if self.tp else (1, 0)
        # how many sequence shards a pp message of X, dX or the embedding is of the whole
        # sequence the S and T passes (and their statistics) cover
        self.sequence_shards = degree if self.sequence_parallel else 1
        if args.vocab_size % (shards * degree):
            raise ValueError(f"vocab_size {args.vocab_size} is not divisible by pp x tp ="
                             f" {shards} x {degree}")
        block = args.vocab_size // shards  # the pipeline rank's rows, split over tp
        rows = block // degree
        self.vocab_start, self.rows = (shard * degree + tp_rank) * rows, rows
        self.args = args
        full = (args.vocab_size, args.dim)

        def rows_of(name: str) -> nn.Parameter:
            value = initial_value(seeded_name(name, args), torch.Size(full), args, seed)
            mine = value[self.vocab_start:self.vocab_start + rows].clone().to(device)
            if self.tp is None:
                return nn.Parameter(mine)
            return nn.Parameter(DTensor.from_local(mine, self.tp, [Shard(0)], run_check=False))

        self.tok_embeddings = VocabRows(rows_of("tok_embeddings.weight"), shard * block,
                                        args.vocab_size)
        self.output = VocabRows(self.tok_embeddings.weight if args.tie_embeddings
                                else rows_of("output.weight"), shard * block, args.vocab_size)

    def _local(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids as rows of this shard (0 outside it) and the mask of those outside."""
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        return local.masked_fill(outside, 0), outside

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """This shard's part of the embedding of ``tokens_BS``: its rows, zero for the tokens of
        other shards (the p parts sum to the full embedding, exactly: one is non-zero)."""
        local, outside = self._local(tokens_BS)
        return F.embedding(local, _own(self.tok_embeddings.weight)).masked_fill(
            outside[..., None], 0.0)

    def s_pass(self, x_BSD: torch.Tensor, targets_BS: torch.Tensor) -> tuple[OutputPass,
                                                                               torch.Tensor]:
        """S: this shard's logits of ``x_BSD`` (fp32, autograd kept from a leaf copy of x) and
        their statistics ``[3, N]``: row max, sum of exp(logit - max), target logit (0 when the
        target is another shard's), for every rank's ``t_pass``."""
        if self.sequence_parallel:  # x_BSD is this tp rank's shard: the whole sequence first
            x_BSD = self.gather_sequence(x_BSD.detach())
        x = x_BSD.detach().requires_grad_(torch.is_grad_enabled())
        with self.autocast():  # bf16 parameters or autocast: bf16 logits, as one process's
            logits = F.linear(x, _own(self.output.weight))
        logits = logits.flatten(0, 1).float()  # then fp32, as the loss upcasts full logits
        local, outside = self._local(targets_BS.flatten(0, 1))
        with torch.no_grad():
            row_max = logits.max(dim=-1).values
            target = logits.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
            # In place: T needs exp(z - max) (its softmax is a rescale of it), never z again, and
            # the matmul's backward reads x and the rows, not its output: one [N, V/p] held.
            exp = logits.sub_(row_max[:, None]).exp_()
            sum_exp = exp.sum(dim=-1)
            stats = torch.stack((row_max, sum_exp, target))
            if self.tp is not None:  # the pipeline rank's statistics: its t shards' combined
                gathered = stats.new_empty((self.tp.size() * 3, stats.shape[1]))
                comm.all_gather_into_tensor(gathered, stats, self.tp.get_group(),
                                            axis="tp_vocab", ledger=self.ledger)
                stats = torch.stack(combine(list(gathered.view(-1, 3, stats.shape[1]))))
        return OutputPass(x, exp, row_max, local, outside), stats

    def sum_over_tp(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` (a pipeline rank's sum of dX parts or of partial embeddings) summed in place
        over the tp ranks, whose shards hold the other rows: every tp rank gets the whole sum.
        A no-op without tp, and under sequence parallelism, where each part was already summed
        over tp by ``scatter_sequence`` before it travelled."""
        if self.tp is not None and not self.sequence_parallel:
            comm.all_reduce(total, self.tp.get_group(), axis="tp_vocab", ledger=self.ledger)
        return total

    def gather_sequence(self, x_BsD: torch.Tensor) -> torch.Tensor:
        """Every tp rank's sequence shard ``[b, S/t, D]`` -> the whole ``[b, S, D]`` (in tp order,
        all-gathered; a tp rank holds the sequence's u-th contiguous part, as SP cuts it).
        Identity without sequence parallelism."""
        if not self.sequence_parallel:
            return x_BsD
        t = self.tp.size()
        B, s, D = x_BsD.shape
        gathered = x_BsD.new_empty((t * B, s, D))  # (gloo gathers along dim 0)
        comm.all_gather_into_tensor(gathered, x_BsD.contiguous(), self.tp.get_group(),
                                    axis="tp_vocab", ledger=self.ledger)
        return gathered.view(t, B, s, D).transpose(0, 1).reshape(B, t * s, D)

    def scatter_sequence(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """A ``[b, S, D]`` part (of dX or the embedding; this rank's rows) -> this tp rank's
        sequence shard of its sum over the tp ranks (reduce-scattered in fp32). Identity without
        sequence parallelism."""
        if not self.sequence_parallel:
            return x_BSD
        t = self.tp.size()
        B, S, D = x_BSD.shape
        # [t·b, S/t, D]: tp rank u's chunk is rows [u b, (u + 1) b) (gloo wants dim 0 cut)
        chunks = x_BSD.detach().float().view(B, t, S // t, D).transpose(0, 1).reshape(
            t * B, S // t, D)
        shard = chunks.new_empty((B, S // t, D))
        comm.reduce_scatter_tensor(shard, chunks, self.tp.get_group(), axis="tp_vocab",
                                   ledger=self.ledger)
        return shard

    def t_pass(self, state: OutputPass, stats: list[torch.Tensor], targets_BS: torch.Tensor,
               loss_fn, *, training: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """T: the loss of ``loss_fn(ShardedLogits, targets)`` from every pipeline rank's ``stats``
        (in rank order; under tp each already its t shards' combination); training: its
        backward through this shard, accumulating the head rows' gradient. Returns the loss
        (detached) and this shard's part of dX (or None; under sequence parallelism this tp
        rank's sequence shard of the tp ranks' sum, ``scatter_sequence``)."""
        row_max, sum_exp, target = combine(stats)
        # this shard's softmax = exp(z - its max) * exp(its max - the max) / the sum
        scale = (state.row_max - row_max).exp_().div_(sum_exp)
        logits = ShardedLogits(state.exp, scale, row_max, sum_exp, target, state.local,
                               state.outside, shape=tuple(targets_BS.shape))
        loss = loss_fn(logits, targets_BS)
        if not training:
            return loss.detach(), None
        loss.backward()
        return loss.detach(), self.scatter_sequence(state.x.grad)


class GatheredRows(FullyShardedSync):
    """ZeRO-3 of a vocabulary shard (FSDP2, one unit: the whole shard), gathered by hand.

    FSDP2 gathers a unit in its forward's pre-hook; a ``VocabShard`` has no forward (the runtime
    calls ``embed``, ``s_pass`` and ``t_pass`` where the schedule puts them). So the runtime calls
    ``gather`` at the step's start; the gathered rows then are the shard's parameters, into
    whose ``.grad`` every pass accumulates, until ``flush`` (training: after the embedding's
    backward; reduce-scatter, HSDP's all-reduce, reshard) or ``reshard`` (evaluation). One
    reduction per step whatever ``sync`` says (no module hook would fire for another), so
    ``finish`` flushes a step the runtime ran with ``sync`` on all along."""

    def __init__(self, shard: nn.Module) -> None:
        super().__init__(shard, per_microbatch=False)
        self.gathered = False

    def gather(self) -> None:
        """All-gather the rows (a no-op when they are gathered). The first call initialises
        FSDP2's state, which its first forward would otherwise do."""
        from torch.distributed.fsdp import fully_shard

        if not self.gathered:
            fully_shard.state(self._model)._lazy_init()
            self._model.unshard()
            self.gathered = True

    def flush(self) -> None:
        """Reduce-scatter the step's accumulated gradients, then reshard."""
        self._sync = False  # accumulated either way: the base class's by-hand reduction
        super().flush()
        self.gathered = False

    def reshard(self) -> None:
        super().reshard()
        self.gathered = False

    def finish(self) -> None:
        if self.gathered:  # sync was on all along: nothing flushed the step's gradients yet
            self.flush()


def data_parallel_rows(shard: VocabShard, meshes: Meshes, job: Job,
                       ledger: CommLedger | None = None
                       ) -> GradientReducer | ZeroShardedOptimizer | GatheredRows | None:
    """The reducer of ``shard``'s gradients over the data axes, in the stages' form (the module
    docstring): ZeRO-3 (``GatheredRows``), ZeRO-1/2 (``zero.apply_zero``, the shard's buckets
    over ``dp_shard``, averaged over ``dp_replicate``) or, at ``dp_shard`` = 1, a
    ``GradientReducer`` over ``dp`` (None at degree 1). Under cp every form takes in the cp
    ranks too, as the stages' do: ZeRO on ``zero_mesh``'s dp_shard x cp, the reducer on
    ``dp_cp``. Under an outer ``dp_mode`` every form leaves ``dp_replicate`` out, as the
    stages' do (the outer loop merges the replicas' rows). Under ``train.dtype = bf16`` each keeps the rows' fp32 masters its own way, as
    for a stage (``loom.parallel.parallelize``)."""
    layout = job.layout
    reduce_dtype = torch.bfloat16 if job.grad_reduce_dtype == "bf16" else torch.float32
    bucket_bytes = int(job.grad_bucket_mb * 2**20)
    # an outer dp_mode merges the replicas' rows itself: averaged inside a replica only
    across_replicas = job.dp_mode == "sync"
    if layout.zero_stage == 3:
        mesh, axis = zero_mesh(meshes, layout, across_replicas)
        compute = torch.bfloat16 if job.dtype in ("bf16", "bf16_autocast") else None
        # gathered and resharded by hand (GatheredRows): FSDP2 never reshards by itself
        apply_fully_shard(shard, mesh, reshard_after_forward=False, reshard_after_backward=False,
                          param_dtype=compute, reduce_dtype=reduce_dtype,
                          offload_optimizer=job.offload_optimizer, ledger=ledger, axis=axis,
                          cast_forward_inputs=job.dtype != "bf16")
        return GatheredRows(shard)
    if layout.zero_stage:
        mesh, axis = zero_mesh(meshes, layout)
        shard_mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim == 2 else mesh
        replicate = meshes.root["dp_replicate"] if across_replicas else None
        return apply_zero(shard, layout.zero_stage, shard_mesh, replicate,
                          axis=axis, reduce_dtype=reduce_dtype, offload=job.offload_optimizer,
                          ledger=ledger, bucket_bytes=bucket_bytes,
                          tp_group=shard.tp.get_group() if shard.tp is not None else None,
                          param_dtype=torch.bfloat16 if job.dtype == "bf16" else torch.float32)
    if job.dtype == "bf16":  # bf16 rows with fp32 masters, before the reducer's hooks
        apply_bf16_parameters(shard, reduce_dtype)
    # cp ranks hold the same rows and other tokens: averaged over dp x cp, as a stage's are
    mesh, axis = (meshes.dp_cp, "dp_cp") if layout.cp > 1 else (meshes.dp, "dp")
    if not across_replicas:  # dp_shard = 1 here (else ZeRO) and no ep: the replica's cp ranks
        mesh, axis = meshes.root["cp"], "cp"
    if mesh.size() == 1:
        return None
    return GradientReducer(list(shard.parameters()), mesh.get_group(), mesh.size(),
                           ledger=ledger, axis=axis, bucket_bytes=bucket_bytes,
                           reduce_dtype=reduce_dtype, compression=job.compression, seed=job.seed)


@dataclass
class OutputPass:
    """What one microbatch's S keeps for its T: the leaf copy of X, exp(logits - the shard's row
    max) in the logits' own storage (so with their graph to X and the head rows) and that max,
    and the targets as rows of the shard."""

    x: torch.Tensor
    exp: torch.Tensor
    row_max: torch.Tensor
    local: torch.Tensor
    outside: torch.Tensor


def _own(weight: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a vocabulary weight (a tp DTensor's local shard, with autograd to it)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def combine(stats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every shard's ``[3, N]`` statistics (rank order) -> the global row max, sum of exp(z - max)
    and target logit: each shard's sum is rescaled by exp(its max - the max), as online softmax
    does, and added in rank order (every rank gets the same bits)."""
    row_max = torch.stack([s[0] for s in stats]).max(dim=0).values
    sum_exp = torch.zeros_like(row_max)
    target = torch.zeros_like(row_max)
    for shard in stats:
        sum_exp += shard[1] * (shard[0] - row_max).exp()
        target += shard[2]
    return row_max, sum_exp, target


@dataclass
class ShardedLogits:
    """One shard's logits, as ``exp`` = exp(logits - the shard's row max) ``[N, V/p]`` (autograd's
    handle on them), and the global statistics of all shards: what a loss function receives in
    place of full logits (``cross_entropy`` reduces it). ``exp`` times ``scale`` (per row) is the
    shard's part of the softmax. ``shape``: the targets' ``[B, S]``."""

    exp: torch.Tensor
    scale: torch.Tensor
    row_max: torch.Tensor
    sum_exp: torch.Tensor
    target: torch.Tensor
    local_target: torch.Tensor
    outside: torch.Tensor
    shape: tuple[int, ...]

    def token_losses(self) -> torch.Tensor:
        """loss_i = log(sum_exp_i) + max_i - target_i, differentiable w.r.t. the local logits."""
        return _ShardCrossEntropy.apply(self.exp, self.scale, self.row_max, self.sum_exp,
                                        self.target, self.local_target, self.outside)


class _ShardCrossEntropy(torch.autograd.Function):
    """Token losses from the global statistics; backward to this shard's logits only:
    softmax - onehot restricted to the shard (``loom.parallel.vocab``'s gradient), the softmax
    being S's exponentials rescaled (no second exp over ``[N, V/p]``). The backward runs once:
    it turns the saved exponentials into the gradient in place."""

    @staticmethod
    def forward(ctx, exp_NV: torch.Tensor, scale_N: torch.Tensor, row_max: torch.Tensor,
                sum_exp: torch.Tensor, target: torch.Tensor, local_target: torch.Tensor,
                outside: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(exp_NV, scale_N, local_target, outside)
        return sum_exp.log() + row_max - target

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        exp, scale, local_target, outside = ctx.saved_tensors
        grad = exp.mul_(scale[:, None])
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad.mul_(grad_N[:, None]), None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor | ShardedLogits, targets_BS: torch.Tensor, *,
                  reduction: str = "mean", **kwargs) -> torch.Tensor:
    """``loom.parallel.vocab.cross_entropy`` that also takes a ``ShardedLogits``: the mean over
    every target, or (``reduction="sum"``, packed rows) the sum over those that are not
    ``IGNORE_INDEX``, as that function reduces full logits."""
    if not isinstance(logits, ShardedLogits):
        return tensor_cross_entropy(logits, targets_BS, reduction=reduction, **kwargs)
    losses = logits.token_losses()
    if reduction == "sum":
        return losses.masked_fill(targets_BS.flatten(0, 1) == IGNORE_INDEX, 0.0).sum()
    return losses.mean()


__all__ = ["VocabShard", "VocabRows", "row_slices", "ShardedLogits", "OutputPass", "combine",
           "cross_entropy", "GatheredRows", "data_parallel_rows"]
