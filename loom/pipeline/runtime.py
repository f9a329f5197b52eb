"""The one pipeline interpreter: runs any validated ``Schedule`` on the stages of this rank.

``PipelineRuntime.step`` walks this rank's action list in order and, for each action, does the
compute of ``loom.pipeline.stage`` plus the communication the action implies. There is no
separate lowered schedule with SEND/RECV actions: which transfers an action needs follows from
the placement alone, so the interpreter derives them on the fly, the same way for every family.

What it communicates, per microbatch and stage boundary that crosses ranks (``pp`` group, gloo or
NCCL point-to-point, fp32 ``[micro, seq, dim]``, i.e. 4·micro·seq·dim bytes each way; under
sequence parallelism each tp rank sends its own sequence shard, ``[micro, seq/tp, dim]``). Every
transfer and reduction below goes through ``loom.parallel.comm`` with the trainer's ledger (axis
``pp``), so ``metrics.comm`` counts it (``tests/dist/test_pipeline_comm.py``: exactly this volume):

* F(s, m) sends its output to the rank of stage s+1; I(s, m) or B(s, m) sends the input gradient
  to the rank of stage s-1. Stage transitions within one rank (the turn of a V placement) hand
  the tensor over in memory, with no communication.
* Receives are posted ``recv_lookahead`` actions ahead of their use into preallocated buffers
  (shapes are known in advance: one per step, or per microbatch under data.packing = varlen,
  from the inputs every rank holds), so they overlap the compute before it; every send is
  asynchronous and only waited for at the end of the step, so no ordering of sends and receives
  can deadlock a schedule that ``loom.schedule.validate`` accepts.
* Tags (``loom.pipeline.transfers``, which derives every action's messages): the transfer into
  stage ``s`` for microbatch ``m`` in direction ``d`` (0 activation, 1 gradient) uses tag
  ``(s·M + m)·2 + d``. Every transfer of a step has its own tag, so matching by (source, tag)
  cannot pair the wrong messages whatever order the ranks post them in.
* Data parallelism: each stage's gradients are reduced by the reducer in its ``parallelize``
  record (``PipelineStage.applied``; ``parallelize`` runs on every stage module, in its one
  order), driven here: every backward piece accumulates with the reducer's ``sync`` off; a
  stage's last piece of the step reduces: a full backward B with ``sync`` on (each bucket
  goes as soon as its gradients are ready, overlapping the rest of that backward), a W by a
  ``flush`` after it; either way it overlaps the rest of the schedule, and
  ``finish_gradient_reduction`` waits for all of them before clipping. Plain data
  parallelism (``dp``, or ``dp_cp`` under cp): the ``GradientReducer``'s bucketed all-reduce
  through ``comm.py``, ``2 (d-1)/d * 4P_stage`` wire bytes per rank per step. ZeRO-3 (FSDP2 on
  ``dp_shard``, HSDP with ``dp_replicate``): ``flush`` runs FSDP2's post-backward by hand (one
  reduce-scatter per unit, ``(d-1)/d * 4P_stage``, and HSDP's all-reduce) and reshards. With
  ``parallel.reshard_after_forward = false`` a stage is gathered once per step, at its first F,
  and held until that flush: ``2 (d-1)/d * 4P_stage`` in all, plain data parallelism's bytes;
  with ``true`` FSDP2 gathers per unit for every F and B (``(2m+1) (d-1)/d * 4P_stage``),
  which only full-backward schedules allow (a W needs the weights its I saw). DDP is not used:
  its hooks assume one backward per step and per module, not a stream of I and W pieces.
* Tied embeddings (``tie_embedding``): the first stage's embedding and the last stage's head are
  two copies of one weight when they sit on different ranks; after the data-parallel reduction,
  ``finish_gradient_reduction`` sums their gradients over the 2-rank group {first stage's rank,
  last stage's rank}: one all-reduce of 4·V·D bytes (/tp under vocab parallelism, /dp_shard
  under ZeRO-3) per step on those two ranks, axis ``pp_tie``. On one rank (V placements) they are
  one Parameter and nothing moves.
* Routes (``bidirectional_v``: two copies of the model, half the microbatches through each).
  Transfers follow each microbatch's route, ends included (a route's first stage takes the
  tokens, its last computes the loss). After the data-parallel reduction,
  ``finish_gradient_reduction`` sums each stage's gradient with its other copy over the ranks
  that hold the copies (``copy_groups``: for bidirectional_v rank r and p-1-r, which hold the
  same four model stages): 4·P_rank bytes per rank per step, P_rank the parameters of the
  rank's stages (under ZeRO-1/2 the reduced slices, 4·P_rank/d), axis ``pp_copies``, one
  all-reduce per model stage started as soon as its last W or B is done on both ranks when
  there is no data-parallel reducer (eager, ``loom.pipeline.route_copies``). Both copies start
  from the same seeded weights and step identically, so they stay bit-identical.
* PipeOffload (``O`` / ``R`` actions, ``loom.schedule.offload``): an F whose (stage, microbatch)
  this rank's list offloads saves its tensors into a ``SavedActivations`` store
  (``loom.pipeline.host_offload``); O copies them to host memory, R back, in list order, on this
  rank only: nothing is communicated.
* Vocabulary parallelism across the pipeline (``parallel.vocab_parallel_pp``: the schedule holds
  S and T passes, ``loom.schedule.vocab_passes``; the shards are ``loom.parallel.vocab_pipeline``'s
  ``VocabShard``), all point-to-point over ``pp`` with tags of their own (virtual stages past
  the last, ``vocab_transfer``): at the step's start every rank sends its partial embedding of
  each microbatch to the first stage's rank ((p-1)·4·micro·seq·dim bytes per microbatch into
  it), which sums them; after F of the last stage its output X goes to every other rank (the
  same volume out of it); S sends its ``[3, micro·seq]`` fp32 statistics to every other rank,
  T its part of dX to the last stage's rank (the volume of X, into it), which sums the parts in
  rank order, in fp32, before its I or B; the first stage's input gradients go back to every
  rank (the volume of the embedding, out of it), which runs its embedding rows' backward after
  the schedule. (Under ``train.dtype = bf16`` X, dX and the embeddings travel in bf16, half
  those bytes; the statistics stay fp32.) Every receive is posted ahead like the others and
  waited just before use, so a schedule the validator accepts (its barriers included) cannot
  deadlock here either. Under tp all of this runs in each tp slice's pp group, and the vocabulary
  shards add tp collectives (``loom.parallel.vocab_pipeline``, axis ``tp_vocab``; under SP the
  pp messages carry sequence shards).
* After the step: one 1-element all-reduce over ``pp`` so every rank reports the loss, which only
  the last stage of each route computes (under vocabulary parallelism: the last stage's rank's
  T passes, every rank having computed the same loss).

Written here rather than taken from ``torch.distributed.pipelining``: torch's runtime interprets
a lowered schedule only for its own ``PipelineStage`` (which traces shapes with a meta forward
and owns DDP/FSDP wrapping), while Loom's IR and stages are its own; the interpreter is ~200 lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from loom.layout import Job
from loom.parallel import comm, parallelize
from loom.parallel.comm import CommLedger
from loom.parallel.data import FullyShardedSync, GradientReducer
from loom.parallel.mixed_precision import gradient_of
from loom.parallel.vocab_pipeline import GatheredRows, OutputPass, VocabShard, data_parallel_rows
from loom.parallel.zero import ZeroShardedOptimizer
from loom.pipeline.host_offload import SavedActivations
from loom.pipeline.partition import partition_model
from loom.pipeline.route_copies import RouteCopySum, copy_units
from loom.pipeline.stage import LossFn, PipelineStage, build_stages
from loom.pipeline.transfers import (ACTIVATION, DX_PART, EMBED_GRAD, EMBED_PART, GRADIENT, STATS,
                                     WIRE_DTYPE, X_OUT, Transfer, incoming, outgoing,
                                     vocab_incoming, vocab_transfer)
from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.vocab_passes import vocab_schedule
from loom.topology import Meshes, RankGrid

if TYPE_CHECKING:
    from loom.pipeline.profile import PipelineRecorder

VOCAB_ROWS = -1  # the key of the vocabulary rows' data-parallel reducer (stages are >= 0)


class PipelineRuntime:
    """Executes schedules on ``stages`` (this rank's, by stage index) of pipeline rank ``pp_rank``.

    ``pp_ranks[i]`` is the global rank of pipeline rank ``i`` in this rank's ``pp`` group.
    ``recorder`` (``loom.pipeline.profile.PipelineRecorder``, default None: off) is told when each
    step and each action's compute begins and ends; set or clear it between steps.
    """

    def __init__(self, schedule: Schedule, stages: dict[int, PipelineStage], pp_rank: int,
                 pp_ranks: Sequence[int], pp_group: dist.ProcessGroup | None,
                 recv_lookahead: int = 4, recorder: PipelineRecorder | None = None,
                 ledger: CommLedger | None = None,
                 tie_group: dist.ProcessGroup | None = None,
                 copy_group: dist.ProcessGroup | None = None,
                 compute_context: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext, reduce_every_microbatch: bool = False,
                 wire_dtype: torch.dtype = WIRE_DTYPE, vocab: VocabShard | None = None,
                 vocab_reducer: GradientReducer | ZeroShardedOptimizer | FullyShardedSync
                 | None = None) -> None:
        if sorted(stages) != list(schedule.stages_of(pp_rank)):
            raise ValueError(f"rank {pp_rank} holds stages {sorted(stages)}, the schedule places "
                             f"{list(schedule.stages_of(pp_rank))} on it")
        self.schedule = schedule
        self.stages = stages
        self.wire_dtype = wire_dtype  # bf16 parameters (train.dtype = bf16): bf16 activations
        self.pp_rank = pp_rank
        self.pp_ranks = tuple(pp_ranks)
        self.pp_group = pp_group
        self.recv_lookahead = recv_lookahead
        self.recorder = recorder
        self.ledger = ledger  # counts the sends, receives and reductions over "pp" (comm.py)
        self.tie_group = tie_group  # {first stage's rank, last stage's rank} of a tied model
        self.copy_group = copy_group  # the ranks holding the other routes' copies of my stages
        # this rank's rows of the embedding and the head, when the schedule has vocabulary
        # passes (S, T): the stages then hold neither
        self.vocab = vocab
        if schedule.has_vocab_passes != (vocab is not None):
            raise ValueError(f"schedule {schedule.name!r} and the vocabulary shard disagree: "
                             "vocabulary passes need a VocabShard on every rank, and only they")
        # entered around every action's compute (forward and backward): the trainer's counting
        # of tensor-parallel collectives and activation offload
        self.compute_context = compute_context
        # ZeRO-2/3 only (train.grad_reduce_every_microbatch): every backward reduces its own
        # gradients, so full-size ones never accumulate; otherwise once per step (below)
        self.reduce_every_microbatch = reduce_every_microbatch
        # the step's MoE load-balancing loss, summed over microbatches and this pipeline's
        # stages (the same on every pipeline rank); None for a dense model
        self.aux_loss: torch.Tensor | None = None
        # PipeOffload (O/R actions, ``loom.pipeline.host_offload``): the last step's bytes moved
        # to the host and back and the seconds the copies took, measured
        self.offload_bytes = 0
        self.offload_seconds = 0.0
        self.moe = next(iter(stages.values())).module.args.n_experts > 0
        # The data-parallel reducer of each stage (none at degree 1), from its parallelize record
        self.reducers = {index: stage.applied.reducer for index, stage in stages.items()
                         if stage.applied is not None and stage.applied.reducer is not None}
        if vocab_reducer is not None:  # the vocabulary rows' reducer, flushed after the step
            self.reducers[VOCAB_ROWS] = vocab_reducer
        self.vocab_reducer = vocab_reducer  # (ZeRO-1/2: the trainer steps its buckets too)
        # Routes: the copies' gradient sum, unit by unit and eagerly (``route_copies``); under
        # ZeRO-1/2 it sums the reduced slices, and the replicas' slices stay out of the norm
        self.copy_sum: RouteCopySum | None = None
        if copy_group is not None:
            pair = next(ranks for ranks in copy_groups(schedule) if pp_rank in ranks)
            tied = next(iter(stages.values())).module.args.tie_embeddings and vocab is None
            self.copy_sum = RouteCopySum(copy_units(schedule, pp_rank, pair, tied), stages,
                                         self.reducers, copy_group, ledger)
            for index, reducer in self.reducers.items():
                if index >= schedule.stages_per_route and \
                        isinstance(reducer, ZeroShardedOptimizer):
                    reducer.leave_out_of_norm()
        final = schedule.num_stages - 1
        if tie_group is not None and 0 not in stages and \
                isinstance(self.reducers.get(final), ZeroShardedOptimizer):
            # the tied head's slices: the first stage's rank counts the summed gradient
            self.reducers[final].leave_out_of_norm("tok_embeddings.weight")
        splits = any(a.op in (Op.I, Op.W) for a in schedule.actions[pp_rank])
        if splits and any(getattr(r, "per_microbatch", False) for r in self.reducers.values()):
            raise ValueError(f"schedule {schedule.name!r} splits the backward into I and W: its "
                             "ZeRO-3 stages must stay gathered across the step "
                             "(reshard_after_forward = false)")

    # -- one step -----------------------------------------------------------------------------------
    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
             loss_fn: LossFn, *, schedule: Schedule | None = None, training: bool = True,
             activation_shape: Sequence[int] | None = None,
             documents: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
             activation_shapes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Run ``schedule`` (default: the training schedule) over the microbatches ``inputs`` /
        ``targets`` (every rank passes all of them; only the ends read them). Returns the sum of
        the microbatch losses, identical on every pipeline rank. ``loss_fn`` should already be
        scaled (e.g. divided by the number of microbatches) as the caller wants it summed.
        ``documents``: packed rows' (positions, document ids) per microbatch, which every
        stage's attention and RoPE need (each rank gets all of them). The receive buffers
        have ``activation_shape``, or with microbatches of different token counts
        (``data.packing = varlen``) ``activation_shapes[m]`` for microbatch m: every rank knows
        every microbatch's shape from its inputs, so no shape travels."""
        schedule = schedule or self.schedule
        if (activation_shape is None) == (activation_shapes is None):
            raise ValueError("pass activation_shape or activation_shapes (one per microbatch)")
        if len(inputs) != schedule.num_microbatches:
            raise ValueError(f"{len(inputs)} microbatches for a schedule of "
                             f"{schedule.num_microbatches}")
        recorder = self.recorder
        if recorder is not None:
            recorder.step_begin()
        row = schedule.actions[self.pp_rank]
        device = next(iter(self.stages.values())).module.rope_cos.device
        last_piece = {}  # stage -> index of its last backward piece: when to reduce over dp
        for index, action in enumerate(row):
            if action.op in (Op.W, Op.B):
                last_piece[action.stage] = index
        for first, final in self.shared_tied_ends:
            if first in last_piece and final in last_piece:
                # The first stage's reducer holds the shared weight: reduce it once both are done.
                last_piece[first] = max(last_piece[first], last_piece[final])
        posted: dict[Transfer, tuple[dist.Work, torch.Tensor]] = {}
        next_to_post = 0
        local: dict[Transfer, torch.Tensor] = {}  # same-rank hand-overs
        sends: list[dist.Work] = []
        loss_sum = torch.zeros((), device=device)
        reduce_once = training and not self.reduce_every_microbatch
        if reduce_once:  # accumulate locally up to each stage's last backward piece
            for reducer in self.reducers.values():
                reducer.sync = False
        for stage in self.stages.values():
            stage.aux_loss_sum = None
        copy_sum = self.copy_sum if training else None
        if copy_sum is not None:
            copy_sum.begin_step()
        # (stage, microbatch) whose saved activations this rank offloads: their F saves into a
        # SavedActivations store, which O and R move to the host and back
        offloads = {(a.stage, a.microbatch) for a in row if a.op is Op.O}
        if offloads and recorder is not None and recorder.track_memory:
            # only the innermost saved_tensors_hooks run: the recorder would miss those tensors
            raise ValueError(f"schedule {schedule.name!r} offloads activations: the recorder's "
                             "track_memory cannot count them; record without it")
        saved: dict[tuple[int, int], SavedActivations] = {}
        self.offload_bytes, self.offload_seconds = 0, 0.0
        # vocabulary parallelism: this rank's partial embeddings (with their graph) and, on the
        # first stage's rank, their sums; the S passes' state until their T
        partial: list[torch.Tensor] = []
        embedded: dict[int, torch.Tensor] = {}
        outputs: dict[int, OutputPass] = {}
        if self.vocab is not None:
            if isinstance(self.reducers.get(VOCAB_ROWS), GatheredRows):  # ZeRO-3: for the step
                self.reducers[VOCAB_ROWS].gather()
            partial, embedded = self._embed(schedule, inputs, training, device, posted, sends,
                                            activation_shape, activation_shapes)

        for index, action in enumerate(row):
            # Post the receives of the next few actions before computing this one.
            while next_to_post < min(len(row), index + 1 + self.recv_lookahead):
                ahead = row[next_to_post]
                single = incoming(schedule, self.pp_rank, ahead)
                for needed in ([single] if single is not None else []) + (
                        vocab_incoming(schedule, self.pp_rank, ahead)
                        if self.vocab is not None else []):
                    shape = activation_shape if activation_shapes is None \
                        else activation_shapes[needed.microbatch]
                    posted[needed] = self._post(schedule, needed, shape, device)
                next_to_post += 1
            if action.op.is_transfer:  # O / R: a host copy, no compute, nothing to send
                key = (action.stage, action.microbatch)
                if action.op is Op.O:
                    saved[key].offload()
                else:  # reloaded: the graph holds the slots from now on
                    store = saved.pop(key)
                    store.reload()
                    self.offload_bytes += store.bytes_moved
                    self.offload_seconds += store.seconds
                continue
            if action.op.is_vocab:  # an output-layer pass on this rank's vocabulary shard
                with self.compute_context():
                    loss_sum += self._vocab_pass(schedule, action, targets, loss_fn, training,
                                                 posted, local, sends, outputs)
                continue
            received = self._receive(schedule, action, posted, local)
            if recorder is not None:  # after the receive: waiting for a message is not compute
                recorder.begin(action)
            stage = self.stages[action.stage]
            mb = action.microbatch
            final_piece = reduce_once and last_piece.get(action.stage) == index \
                and action.stage in self.reducers
            if final_piece and action.op is Op.B:
                # A full backward runs autograd's hooks: the reducer reduces each bucket as
                # its gradients are ready, overlapping the rest of this backward (as DDP does)
                self.reducers[action.stage].sync = True
            hooks: contextlib.AbstractContextManager = contextlib.nullcontext()
            if action.op is Op.F and (action.stage, mb) in offloads:
                saved[action.stage, mb] = SavedActivations(str(action),
                                                           resident=stage.module.buffers())
                hooks = saved[action.stage, mb].hooks()
            with self.compute_context(), hooks:
                if action.op is Op.F:
                    x = inputs[mb] if stage.takes_tokens else \
                        embedded[mb] if stage.is_first else received
                    out = stage.forward(mb, x, targets[mb], loss_fn, training=training,
                                        documents=documents[mb] if documents else None)
                    result = None if stage.is_last else out
                    if stage.computes_loss:
                        loss_sum += out.detach().float()
                    elif stage.is_last:  # vocabulary-parallel: X to every rank's shard
                        self._send_all(schedule, X_OUT, mb, out, local, sends)
                elif action.op is Op.I:
                    result = stage.backward_input(mb, received)
                elif action.op is Op.B:
                    result = stage.backward(mb, received)
                else:
                    result = stage.backward_weight(mb)
            if self.vocab is not None and stage.is_first and action.op in (Op.I, Op.B):
                # the embedding's gradient, for every rank's rows (after the schedule)
                self._send_all(schedule, EMBED_GRAD, mb, result, local, sends)
            transfer = outgoing(schedule, action)
            if transfer is not None and result is not None:
                # The residual stream's dtype on the wire: fp32 in fp32 and under bf16 autocast
                # (the embedding is fp32), bf16 with bf16 parameters: a no-op view in practice.
                payload = result.detach().to(self.wire_dtype).contiguous()
                if transfer.peer == self.pp_rank:
                    local[transfer] = payload
                else:
                    sends.append(comm.isend(payload, self.pp_ranks[transfer.peer],
                                            self.pp_group, axis="pp", ledger=self.ledger,
                                            tag=transfer.tag(schedule.num_microbatches)))
            if recorder is not None:  # what an I leaves for its W, beyond autograd's saved tensors
                recorder.end(action, stage.held_for_weight(mb) if action.op is Op.I else ())
            if final_piece:  # what the hooks did not reduce (all of it after a W) goes now,
                self.reducers[action.stage].flush()  # overlapping the rest of the schedule
            if copy_sum is not None:  # eager: the copy sums this action completes start now
                copy_sum.after_action(index)
        if self.vocab is not None and training:
            self._embedding_backward(schedule, partial, posted, local)
            if reduce_once and VOCAB_ROWS in self.reducers:  # the rows' last gradient is in
                self.reducers[VOCAB_ROWS].flush()
        for work in sends:
            work.wait()
        for reducer in self.reducers.values():
            if training:
                reducer.sync = True
            elif isinstance(reducer, FullyShardedSync):  # ZeRO-3 stages held gathered
                reducer.reshard()
        totals = loss_sum
        if training and self.moe:  # every pipeline rank all-reduces the same shape
            aux = sum((stage.aux_loss_sum for stage in self.stages.values()
                       if stage.aux_loss_sum is not None), torch.zeros((), device=device))
            totals = torch.stack([loss_sum, aux.float()])
        if len(self.pp_ranks) > 1:  # only the last stage's loss is non-zero
            comm.all_reduce(totals, self.pp_group, axis="pp", ledger=self.ledger)
        if totals.dim():
            loss_sum, self.aux_loss = totals[0], totals[1]
        if recorder is not None:
            recorder.step_end()
        return loss_sum

    def _receive(self, schedule: Schedule, action: Action,
                 posted: dict[Transfer, tuple[dist.Work, torch.Tensor]],
                 local: dict[Transfer, torch.Tensor]) -> torch.Tensor | None:
        """The tensor ``action`` consumes from a neighbouring stage (waiting just before use)."""
        if self.vocab is not None and action.op in (Op.I, Op.B) \
                and action.stage == schedule.num_stages - 1:
            return self._gathered(schedule, DX_PART, action.microbatch, posted, local,
                                  sum_parts=True)
        needed = incoming(schedule, self.pp_rank, action)
        if needed is not None:
            work, buffer = posted.pop(needed)
            work.wait()
            return buffer
        s, mb = action.stage, action.microbatch
        if action.op is Op.F and not schedule.is_first(s):
            return local.pop(Transfer(s, mb, ACTIVATION, self.pp_rank))
        if action.op in (Op.I, Op.B) and not schedule.is_last(s):
            return local.pop(Transfer(s, mb, GRADIENT, self.pp_rank))
        return None

    # -- vocabulary parallelism (loom.parallel.vocab_pipeline) ------------------------------------
    def _post(self, schedule: Schedule, needed: Transfer, shape: Sequence[int],
              device: torch.device) -> tuple[dist.Work, torch.Tensor]:
        """Post the receive of ``needed`` into a new buffer: activation-shaped, or for softmax
        statistics ``[3, tokens]`` fp32 (the whole sequence's: under SP ``shape`` is a shard's)."""
        if needed.stage == schedule.num_stages + STATS:
            tokens = shape[0] * shape[1] * self.vocab.sequence_shards
            buffer = torch.empty((3, tokens), dtype=torch.float32, device=device)
        else:
            buffer = torch.empty(tuple(shape), dtype=self.wire_dtype, device=device)
        work = comm.irecv(buffer, self.pp_ranks[needed.peer], self.pp_group, axis="pp",
                          ledger=self.ledger, tag=needed.tag(schedule.num_microbatches))
        return work, buffer

    def _send_all(self, schedule: Schedule, kind: int, mb: int, tensor: torch.Tensor,
                  local: dict[Transfer, torch.Tensor], sends: list[dist.Work]) -> None:
        """``tensor`` to every rank (this one's copy in memory)."""
        payload = tensor.detach()
        if kind != STATS:
            payload = payload.to(self.wire_dtype)
        payload = payload.contiguous()
        for peer in range(schedule.pp_size):
            self._send(schedule, kind, mb, peer, payload, local, sends)

    def _send(self, schedule: Schedule, kind: int, mb: int, peer: int, payload: torch.Tensor,
              local: dict[Transfer, torch.Tensor], sends: list[dist.Work]) -> None:
        if peer == self.pp_rank:
            local[vocab_transfer(schedule, kind, mb, peer)] = payload
            return
        transfer = vocab_transfer(schedule, kind, mb, self.pp_rank)  # as the receiver names it
        sends.append(comm.isend(payload, self.pp_ranks[peer], self.pp_group, axis="pp",
                                ledger=self.ledger, tag=transfer.tag(schedule.num_microbatches)))

    def _gathered(self, schedule: Schedule, kind: int, mb: int,
                  posted: dict[Transfer, tuple[dist.Work, torch.Tensor]],
                  local: dict[Transfer, torch.Tensor], *, sum_parts: bool = False
                  ) -> list[torch.Tensor] | torch.Tensor:
        """Every rank's message of ``kind`` for ``mb``, in rank order (this rank's from memory):
        the list, or with ``sum_parts`` their sum, added in rank order (the same bits on every
        layout of the same pp)."""
        parts = []
        for peer in range(schedule.pp_size):
            if peer == self.pp_rank:
                parts.append(local.pop(vocab_transfer(schedule, kind, mb, peer)))
            else:
                work, buffer = posted.pop(vocab_transfer(schedule, kind, mb, peer))
                work.wait()
                parts.append(buffer)
        if not sum_parts:
            return parts
        # added in fp32 (bf16 parts: one rounding of the sum, not one per addition)
        total = parts[0].to(torch.float32, copy=True)
        for part in parts[1:]:
            total += part
        # under tp the other tp ranks' shards hold the other rows: theirs are added (tp_vocab)
        return self.vocab.sum_over_tp(total).to(parts[0].dtype)

    def _vocab_pass(self, schedule: Schedule, action: Action, targets: Sequence[torch.Tensor],
                    loss_fn: LossFn, training: bool,
                    posted: dict[Transfer, tuple[dist.Work, torch.Tensor]],
                    local: dict[Transfer, torch.Tensor], sends: list[dist.Work],
                    outputs: dict[int, OutputPass]) -> torch.Tensor | float:
        """Run S or T of ``action`` on this rank's shard; returns the loss this rank reports (T on
        the last stage's rank), else 0. The recorder times the compute, after the receives."""
        mb, last_rank = action.microbatch, schedule.rank_of(schedule.num_stages - 1)
        if action.op is Op.S:
            if last_rank == self.pp_rank:
                x = local.pop(vocab_transfer(schedule, X_OUT, mb, self.pp_rank))
            else:
                work, x = posted.pop(vocab_transfer(schedule, X_OUT, mb, last_rank))
                work.wait()
            if self.recorder is not None:
                self.recorder.begin(action)
            with contextlib.nullcontext() if training else torch.no_grad():
                outputs[mb], stats = self.vocab.s_pass(x, targets[mb])
            self._send_all(schedule, STATS, mb, stats, local, sends)
            if self.recorder is not None:
                self.recorder.end(action)
            return 0.0
        stats = self._gathered(schedule, STATS, mb, posted, local)
        if self.recorder is not None:
            self.recorder.begin(action)
        loss, dx = self.vocab.t_pass(outputs.pop(mb), stats, targets[mb], loss_fn,
                                     training=training)
        if dx is not None:
            self._send(schedule, DX_PART, mb, last_rank, dx.to(self.wire_dtype).contiguous(),
                       local, sends)
        if self.recorder is not None:
            self.recorder.end(action)
        return loss.float() if last_rank == self.pp_rank else 0.0

    def _embed(self, schedule: Schedule, inputs: Sequence[torch.Tensor], training: bool,
               device: torch.device, posted: dict[Transfer, tuple[dist.Work, torch.Tensor]],
               sends: list[dist.Work], activation_shape: Sequence[int] | None,
               activation_shapes: Sequence[Sequence[int]] | None
               ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """The step's start: this rank's partial embedding of every microbatch, sent to the first
        stage's rank, which sums the p parts (exact: one is non-zero per token). Training: the
        other ranks post the receives of the embedding's gradients for after the schedule."""
        first_rank = schedule.rank_of(0)
        mbs = range(schedule.num_microbatches)
        shape = (lambda mb: activation_shape) if activation_shapes is None \
            else (lambda mb: activation_shapes[mb])
        with contextlib.nullcontext() if training else torch.no_grad():
            partial = [self.vocab.embed(inputs[mb]) for mb in mbs]
        local: dict[Transfer, torch.Tensor] = {}
        if first_rank != self.pp_rank:
            for mb in mbs:
                # (under SP this tp rank's sequence shard of the tp ranks' sum)
                part = self.vocab.scatter_sequence(partial[mb].detach())
                self._send(schedule, EMBED_PART, mb, first_rank,
                           part.to(self.wire_dtype).contiguous(), local, sends)
                if training:
                    needed = vocab_transfer(schedule, EMBED_GRAD, mb, first_rank)
                    posted[needed] = self._post(schedule, needed, shape(mb), device)
            return partial, {}
        for mb in mbs:
            for peer in range(schedule.pp_size):
                if peer != self.pp_rank:
                    needed = vocab_transfer(schedule, EMBED_PART, mb, peer)
                    posted[needed] = self._post(schedule, needed, shape(mb), device)
            local[vocab_transfer(schedule, EMBED_PART, mb, self.pp_rank)] = \
                self.vocab.scatter_sequence(partial[mb].detach()).to(self.wire_dtype)
        embedded = {mb: self._gathered(schedule, EMBED_PART, mb, posted, local, sum_parts=True)
                    for mb in mbs}
        return partial, embedded

    def _embedding_backward(self, schedule: Schedule, partial: list[torch.Tensor],
                            posted: dict[Transfer, tuple[dist.Work, torch.Tensor]],
                            local: dict[Transfer, torch.Tensor]) -> None:
        """After the schedule: the first stage's input gradient of every microbatch, through this
        rank's embedding rows, in microbatch order (one process's accumulation order)."""
        first_rank = schedule.rank_of(0)
        for mb, part in enumerate(partial):
            if first_rank == self.pp_rank:
                grad = local.pop(vocab_transfer(schedule, EMBED_GRAD, mb, self.pp_rank))
            else:
                work, grad = posted.pop(vocab_transfer(schedule, EMBED_GRAD, mb, first_rank))
                work.wait()
            grad = self.vocab.gather_sequence(grad)  # under SP: the whole sequence's, over tp
            torch.autograd.backward(part, grad.to(part.dtype))

    # -- data-parallel gradient reduction -------------------------------------------------------------
    def finish_gradient_reduction(self) -> None:
        """Wait for every stage's gradient reduction and write the averages back; then sum the
        copies of each stage over the routes (``copy_group``) and the two copies of a tied
        embedding's gradient over the tie group."""
        for reducer in self.reducers.values():
            reducer.finish()
        if self.copy_sum is not None:
            self.copy_sum.finish()
        if self.tie_group is not None:
            param = self.tied_weight
            end = 0 if 0 in self.stages else self.schedule.num_stages - 1
            if isinstance(self.reducers.get(end), ZeroShardedOptimizer):
                # ZeRO-1/2: each copy is bucketed alone, so the two stages' reduced slices
                # line up; their sum is what both optimizers step
                comm.all_reduce(self.reducers[end].alone_gradient("tok_embeddings.weight"),
                                self.tie_group, axis="pp_tie", ledger=self.ledger)
                return
            # zeros if none (cannot happen in a training step; keeps the pair matched); a bf16
            # parameter's gradient is its fp32 ``main_grad`` (loom.parallel.mixed_precision)
            grad = gradient_of(param, create=True)
            # Data parallelism first (each copy averaged over dp by its stage's reducer, inside
            # the schedule), then this sum: both are linear, so the order does not change the
            # result, and this way the dp reduction keeps overlapping the schedule. A sum of two
            # values is the same bits on both ranks, so the copies stay identical.
            local = getattr(grad, "_local_tensor", grad)
            comm.all_reduce(local, self.tie_group, axis="pp_tie", ledger=self.ledger)

    def route_replicas(self) -> list[nn.Module]:
        """The modules of this rank's stages whose route-0 copy another rank holds (the global
        norm counts those parameters there; see ``LocalStages``). Under ZeRO-1/2 none: the
        sharded optimizer leaves those stages' slices out of its norm itself."""
        return [stage.module for index, stage in sorted(self.stages.items())
                if index >= self.schedule.stages_per_route
                and not isinstance(self.reducers.get(index), ZeroShardedOptimizer)]

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding (the embedding on the first stage, the head on
        the last), None for an untied model or a rank holding neither end."""
        final = self.schedule.num_stages - 1
        if not self.stages[next(iter(self.stages))].module.args.tie_embeddings:
            return None
        if 0 in self.stages:
            return self.stages[0].module.tok_embeddings.weight
        return self.stages[final].module.output.weight if final in self.stages else None

    @property
    def shared_tied_ends(self) -> list[tuple[int, int]]:
        """(first, last) stage of each route of a tied model whose two ends this rank holds:
        they share one Parameter."""
        if not self.stages[next(iter(self.stages))].module.args.tie_embeddings or self.vocab:
            return []  # (vocabulary-parallel: the shard holds the one tied Parameter)
        return [(first, final) for first, final in route_ends(self.schedule)
                if first != final and first in self.stages and final in self.stages]


def build_pipeline(job: Job, schedule: Schedule, *, grid: RankGrid, meshes: Meshes, rank: int,
                   device: torch.device, autocast=None, cp_groups=None,
                   ledger: CommLedger | None = None,
                   compute_context: Callable[[], contextlib.AbstractContextManager]
                   = contextlib.nullcontext) -> PipelineRuntime:
    """This rank's stages (``job``'s model split by ``partition_model``) and the runtime that
    drives them, with the ``pp`` group of ``meshes`` (the meshes of ``grid``; None at pp = 1).
    Every pp builds this way: at pp = 1 the one stage is the whole model and the schedule
    (``schedule_of``) is gradient accumulation.

    ``parallelize`` is applied to each stage module with the same ``job``, so a stage gets
    exactly what a whole model gets, in the same order: TP on the ``tp`` mesh, the cp attention
    core, recomputation, then the data-parallel reducer (over dp, or dp x cp) or ZeRO on
    ``dp_shard`` (ZeRO-3 gathered across the step unless ``reshard_after_forward``); each
    stage keeps the record in ``PipelineStage.applied``.
    """
    args = job.args
    if job.vocab_parallel_pp and not schedule.has_vocab_passes:
        schedule = vocab_schedule(schedule)
    layers = partition_model(args, schedule.stages_per_route, job.seq_len,
                             vocab_spread=schedule.has_vocab_passes)
    pp_rank = grid.coords(rank)["pp"]
    kwargs = {"autocast": autocast} if autocast is not None else {}
    stages = build_stages(args, schedule, layers, pp_rank, device, job.seed, **kwargs)
    if schedule.has_vocab_passes:  # the stages hold no embedding or head for tp to split
        job = replace(job, layout=replace(job.layout, vocab_parallel=False))
    for stage in stages.values():
        stage.applied = parallelize(stage.module, meshes, job, cp_groups=cp_groups, ledger=ledger)
        stage.module = stage.applied.module
        # A block recomputed in full saves placeholders that unpack once: the freeing I/W split
        # reads a matmul's input before its node does, so such stages keep the retaining split.
        stage.free_graph_after_input_grad = job.layout.recompute in ("none", "selective")
    tie_group = tie_embedding(args, schedule, stages, grid, rank)
    copy_group = None
    if schedule.num_routes > 1:  # creating groups is collective: every rank, the same order
        pairs = copy_groups(schedule)
        for members in grid.groups("pp"):  # ordered by pp coordinate
            for pair in pairs:
                ranks = [members[r] for r in pair]
                group = dist.new_group(ranks)
                if rank in ranks:
                    copy_group = group
    pp_group = meshes.root["pp"].get_group() if grid.degree("pp") > 1 else None
    vocab = vocab_reducer = None
    if schedule.has_vocab_passes:
        vocab = VocabShard(args, pp_rank, schedule.pp_size, device, job.seed, **kwargs,
                           tp=meshes.root["tp"] if grid.degree("tp") > 1 else None, ledger=ledger,
                           sequence_parallel=job.layout.sequence_parallel)
        # over the data axes as the stages: plain dp (x cp), ZeRO-1/2 or ZeRO-3 (ep: refused)
        vocab_reducer = data_parallel_rows(vocab, meshes, job, ledger)
    return PipelineRuntime(schedule, stages, pp_rank, grid.group(rank, "pp"), pp_group,
                           vocab=vocab, vocab_reducer=vocab_reducer,
                           ledger=ledger, tie_group=tie_group, copy_group=copy_group,
                           compute_context=compute_context,
                           reduce_every_microbatch=job.grad_reduce_every_microbatch,
                           wire_dtype=torch.bfloat16 if job.dtype == "bf16" else WIRE_DTYPE)


def route_ends(schedule: Schedule) -> list[tuple[int, int]]:
    """(first, last) stage of every route (one pair without routes: (0, n-1))."""
    length = schedule.stages_per_route
    return [(k * length, k * length + length - 1) for k in range(schedule.num_routes)]


def _share_tied_weight(first: PipelineStage, last: PipelineStage) -> None:
    """Make the last stage's head the first stage's embedding Parameter (both on this rank),
    kept by the first stage's data-parallel reducer only."""
    shared, head = first.module.tok_embeddings.weight, last.module.output
    for stage in (first, last):
        reducer = stage.applied.reducer if stage.applied is not None else None
        if reducer is not None and not isinstance(reducer, GradientReducer):
            raise ValueError("tied embeddings on one pipeline rank (a V placement) share one"
                             " Parameter between two stages, which ZeRO-3 cannot shard"
                             " twice; use dp_replicate or a looped schedule")
    replaced, head.weight = head.weight, shared
    if reducer is not None:  # the last stage's
        reducer.drop([replaced, shared])


def copy_groups(schedule: Schedule) -> list[tuple[int, ...]]:
    """The pipeline ranks that hold the copies of the same model stages, one tuple per set.

    The runtime sums gradients over each set, which needs every rank to hold one copy of each of
    its model stages, and the other copies on the same other ranks: for ``bidirectional_v``
    rank r and its mirror p-1-r hold the same four model stages, two on each route. Raises
    ValueError when a placement does not pair up that way (with an odd p the middle rank would
    hold both copies of its stages).
    """
    length = schedule.stages_per_route
    sets: list[tuple[int, ...]] = []
    for rank in range(schedule.pp_size):
        model_stages = [s % length for s in schedule.stages_of(rank)]
        if len(set(model_stages)) != len(model_stages):
            raise ValueError(f"{schedule.name}: pipeline rank {rank} holds two copies of one model"
                             f" stage ({sorted(model_stages)}), which the runtime cannot train")
        holders = {tuple(sorted({schedule.rank_of(j + k * length)
                                 for k in range(schedule.num_routes)})) for j in model_stages}
        if len(holders) != 1:
            raise ValueError(f"{schedule.name}: the copies of pipeline rank {rank}'s stages lie on"
                             f" different ranks ({sorted(holders)}); one gradient sum per rank"
                             " needs them on the same ones")
        (holder,) = holders
        if holder not in sets:
            sets.append(holder)
    return sets


def tie_embedding(args, schedule: Schedule, stages: dict[int, PipelineStage], grid,
                  rank: int) -> dist.ProcessGroup | None:
    """Tie the embedding (first stage) to the output head (last stage), Megatron's way.

    Both start from the embedding's seeded value (``loom.models.llama.seeded_name``). When one
    rank holds both ends (V placements) they are one Parameter: it is re-tied here after
    ``parallelize`` (TP makes a new DTensor per stage) and only the first stage's data-parallel
    reducer keeps it. Otherwise each end's rank holds a copy, and the runtime sums the two
    gradients after the step over the 2-rank group {first stage's rank, last stage's rank} of
    each pipeline, returned here for this rank (None when it holds neither end or both).
    Creating the groups is collective: every rank calls this with the same schedule. With routes
    (bidirectional_v) each copy's two ends sit on one rank (copy 0's on rank 0, copy 1's on rank
    p-1) and are shared there; the copy sum then adds the two copies' shared weight like any
    other parameter.
    """
    if not args.tie_embeddings or schedule.stages_per_route == 1 or schedule.has_vocab_passes:
        return None  # (vocabulary-parallel: each rank's shard ties its own rows)
    ends = route_ends(schedule)
    if all(schedule.rank_of(first) == schedule.rank_of(final) for first, final in ends):
        for first, final in ends:  # each route's (each model copy's) ends on one rank
            if first in stages:
                _share_tied_weight(stages[first], stages[final])
        return None
    if schedule.num_routes > 1:  # no schedule with routes places them so; refuse, do not guess
        raise ValueError(f"{schedule.name}: tied embeddings need each route's first and last"
                         " stage on one rank")
    final = schedule.num_stages - 1
    first_rank, last_rank = schedule.rank_of(0), schedule.rank_of(final)
    mine = None
    for members in grid.groups("pp"):  # ordered by pp coordinate
        pair = [members[first_rank], members[last_rank]]
        group = dist.new_group(pair)
        if rank in pair:
            mine = group
    return mine
