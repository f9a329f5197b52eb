"""The training loop of one rank: setup is a short list of builder calls, a step is explicit.

``Trainer(config, data_dir, run_dir)`` builds, in order: the rank's process context, the
``RankGrid`` and ``DeviceMesh``, this rank's pipeline stages through
``loom.pipeline.runtime.build_pipeline`` for every pp (at pp = 1 one stage, the whole model, with
gradient accumulation as its schedule; each stage made on the meta device, seeded by parameter
name and given ``loom.parallel.parallelize``), AdamW with warmup + cosine, and the sharded data
loader. ``train_step`` does one optimizer step: the schedule runs the rank's microbatches
(each stage's gradient reduction starts within its last backward piece, overlapping what
follows), then clip by the global norm and step. ``fit`` loops, evaluates, logs and saves the
final weights.

What one step communicates (data parallelism): the gradient all-reduce over ``dp`` issued by
``loom.parallel.data``'s reducer (or ZeRO's reduce-scatter / all-gather), plus one 1-element
all-reduce of the loss for logging (and one of the load-balancing loss with MoE). With
``pp > 1`` the runtime's docstring lists the point-to-point traffic; the step adds a 1-element
all-reduce over ``pp`` for the clipping norm and one for the loss (two elements with MoE).

Outer-loop data parallelism (``parallel.dp_mode`` = diloco, noloco or co2): each ``dp_replicate``
replica trains on its own part of every global batch; the gradient reduction covers only the
replica's own data ranks (dp_shard, cp), the clipping norm is the replica's, and every
``parallel.outer_steps`` inner steps ``loom.parallel.outer.OuterLoop`` merges the replicas'
weights over the rank's dp_replicate group (its table lists the bytes). Only the 1-element loss
mean still spans the replicas each step, so the logged loss is the same number as under sync.
Checkpoints keep one state per replica (``loom.train.checkpointing``). A non-finite loss or gradient
norm in any replica stops or skips every replica alike (the norm poisons the shared loss mean).

The loss is the mean token cross entropy over the *global* batch: each microbatch's mean is
divided by the number of microbatches and the reducer averages over equally sized rank batches, so every
layout computes the same number as one process (the parity tests check exactly that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loom.config import Config, compression_of, job_of, layout_of, model_args
from loom.config_rules import varlen_budgets
from loom.config_rules.data import zeppelin_over_dp
from loom.data.loader import DataFiles, DistributedLoader, eval_batches
from loom.data.packing import IGNORE_INDEX, DocumentBatch
from loom.data.varlen import VarlenBatch, VarlenLoader, varlen_eval_batches
from loom.formulas.flops import model_flops_per_token
from loom.grid_summary import describe_grid
from loom.models.moe import set_aux_loss_backward_scale
from loom.models.pretrained import PretrainedSource
from loom.parallel import comm, vocab_pipeline
from loom.parallel.comm import CommLedger
from loom.parallel.context import CPLayout, new_cp_groups, shard_documents, shard_sequence
from loom.parallel.context_documents import take_shard
from loom.parallel.zeppelin_cp import with_remap
from loom.parallel.zeppelin_placement import (merge_dp_microbatches, model_token_costs,
                                              zeppelin_shard_indices)
from loom.parallel.compression import GradCompressor, build_compressor
from loom.parallel.expert import expert_parameter_names, reduce_gradients, sequence_shard_lengths
from loom.parallel.fp8 import precompute_all_gather_scales
from loom.parallel.load import load_local_shards
from loom.parallel.mixed_precision import master_window
from loom.parallel.offload import activation_offload, plan_offload
from loom.parallel.outer import OuterLoop
from loom.parallel.zero import of_stages
from loom.pipeline.out_of_order import build_out_of_order_pipeline
from loom.pipeline.paths_runtime import PathPipeline, build_path_pipeline
from loom.pipeline.runtime import build_pipeline
from loom.pipeline.transfers import forward_only
from loom.pipeline.stage import LocalStages
from loom.schedule.paths import SKIPPIPE
from loom.schedule.select import schedule_of
from loom.topology import DATA_AXES, INNER_DATA_AXES, build_mesh
from loom.train import checkpointing, full_state, preempt
from loom.train.distributed import DistContext, init_distributed
from loom.train.emulated_speed import slowed_to
from loom.train.flops import describe_peak, device_peak_flops
from loom.train.metrics import MetricsLogger, StepTimer, peak_memory_bytes
from loom.train.optim import build_optimizer, build_scheduler
from loom.train.post_validation import PendingMean, optimizer_step_for
from loom.train.profiling import StepProfiler
from loom.train.trackers import open_trackers
from loom.train.watchdog import CollectiveWatch



def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor,
                  reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy (mean or sum over the targets that are not -100, padding),
    computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten(0, 1),
                           reduction=reduction)


class Trainer:
    """One rank's model, optimizer and data, driven by ``train_step`` / ``fit``."""

    def __init__(self, config: Config, data_dir: str | Path, run_dir: str | Path | None = None,
                 ctx: DistContext | None = None) -> None:
        tr = config.train
        self.config = config
        self.run_dir = Path(run_dir) if run_dir else None
        self.ctx = ctx or init_distributed(tr.device, tr.backend, tr.timeout_s, tr.threads)
        self.layout = layout_of(config)  # the one value the estimator and the planner price too
        self.grid = self.layout.grid()
        if self.grid.size != self.ctx.world_size:
            raise ValueError(f"layout {self.layout.label()} needs {self.grid.size} ranks,"
                             f" the job has {self.ctx.world_size}")
        self.meshes = build_mesh(self.grid, self.ctx.device.type)
        self.dp_rank = self.grid.index(self.ctx.rank, *DATA_AXES)
        self.dp_size = self.grid.degree(*DATA_AXES)
        # The loss is averaged over every rank holding a different part of the batch: the data
        # axes, and cp (each cp rank holds a different part of every sequence).
        self.loss_group = self.meshes.dp_cp.get_group()
        self.loss_group_size = self.meshes.dp_cp.size()
        # Outer-loop data parallelism (parallel.dp_mode != sync, loom.parallel.outer): each
        # dp_replicate replica trains on its own part of the batch, its gradients (and packed
        # rows' token counts) averaged inside it only; the logged loss stays the mean over every
        # replica (one scalar all-reduce per step, as in sync: the same number for both).
        self.replica = self.grid.coords(self.ctx.rank)["dp_replicate"]
        self.token_group, self.token_group_size = self.loss_group, self.loss_group_size
        if config.parallel.dp_mode != "sync":  # the replica's dp_shard x ep x cp ranks
            inner = self.meshes.replica
            self.token_group, self.token_group_size = inner.get_group(), inner.size()
        self.ledger = CommLedger() if config.metrics.comm else None
        self.cp_groups = None
        lay = self.layout
        # data.balance = zeppelin over dp > 1: one placement domain of every dp x cp rank (under
        # an outer dp_mode, of the replica's), its groups over the flattened dp x cp index (cp
        # innermost; loom.parallel.zeppelin_cp)
        self.placed_over_dp = (config.data.balance == "zeppelin"
                               and zeppelin_over_dp(config) is None)
        self.domain_axes = DATA_AXES if config.parallel.dp_mode == "sync" else INNER_DATA_AXES
        if self.placed_over_dp:
            self.cp_groups = new_cp_groups(
                self.grid.groups(*self.domain_axes, "cp"),
                CPLayout.from_mode("ring", self.grid.degree(*self.domain_axes) * lay.cp),
                self.ctx.rank, sub_rings=True)
        elif lay.cp > 1:
            split = CPLayout.from_mode(lay.cp_mode, lay.cp, lay.cp_ulysses)
            self.cp_groups = new_cp_groups(self.grid.groups("cp"), split, self.ctx.rank,
                                           sub_rings=config.data.balance == "zeppelin")
        if config.data.zeppelin_remap:  # shards in linear layout, remapped in attention
            self.cp_groups = dataclasses.replace(self.cp_groups, sub_rings=with_remap(
                self.cp_groups.sub_rings, model_token_costs(model_args(config)), lay.cp))

        self.args = model_args(config)

        self.offload = plan_offload(self.ctx.device, activations=tr.offload_activations,
                                    optimizer=tr.offload_optimizer)
        # bf16_autocast: fp32 parameters, autocast compute; bf16: bf16 parameters with fp32
        # masters (loom.parallel.mixed_precision, zero.py, FSDP2), no autocast
        self.autocast_dtype = torch.bfloat16 if tr.dtype == "bf16_autocast" else None
        job = job_of(config, offload_optimizer=self.offload.optimizer)
        # This rank's stages of the schedule, for any pp (at pp = 1 one stage, the whole model,
        # and gradient accumulation as its schedule): each made on the meta device, seeded by
        # parameter name (identical on every rank; TP keeps each rank's slice of the full
        # seeded value) and parallelized. ``LocalStages`` presents them under global parameter
        # names for the optimizer, checkpoints and parity; the runtime drives them.
        if lay.schedule == SKIPPIPE:  # per-microbatch paths over stage replicas (issue 18)
            self.pipeline = build_path_pipeline(
                job, config.parallel.skip_ratio, grid=self.grid, meshes=self.meshes,
                rank=self.ctx.rank, device=self.ctx.device, autocast=self._autocast,
                ledger=self.ledger, compute_context=self._compute_context,
                cluster=self.ctx.cluster)  # an emulated cluster: paths planned on it
        elif config.fault.recovery == "checkfree_plus":  # CheckFree+'s out-of-order microbatches
            self.pipeline = build_out_of_order_pipeline(
                job, schedule_of(lay, max_stages=self.args.n_layers), grid=self.grid,
                meshes=self.meshes, rank=self.ctx.rank, device=self.ctx.device,
                autocast=self._autocast, ledger=self.ledger,
                compute_context=self._compute_context)
        else:
            schedule = schedule_of(lay, max_stages=self.args.n_layers)
            self.pipeline = build_pipeline(job, schedule, grid=self.grid, meshes=self.meshes,
                                           rank=self.ctx.rank, device=self.ctx.device,
                                           autocast=self._autocast, cp_groups=self.cp_groups,
                                           ledger=self.ledger,
                                           compute_context=self._compute_context)
        stages = [stage for _, stage in sorted(self.pipeline.stages.items())]
        self.model = LocalStages([s.module for s in stages],
                                 replicas=self.pipeline.route_replicas(),
                                 vocab=self.pipeline.vocab)
        # What parallelize applied, passed explicitly to the optimizer, clipping, checkpoints
        # and gathering: every stage of this rank had the same (any one's TP / EP records), and
        # ZeRO-1/2 steps the stages' slices as one sharded optimizer
        self.tp, self.ep = stages[0].applied.tensor, stages[0].applied.experts
        # (and the vocabulary rows', parallel.vocab_parallel_pp: theirs are one more part)
        rows = getattr(self.pipeline, "vocab_reducer", None)
        parts = [s.applied.reducer for s in stages] + ([rows] if rows is not None else [])
        self.zero = of_stages(parts, self.pipeline.pp_group)
        self.pretrained_bytes_read = 0
        if config.model.init_from:  # pretrained weights: each rank reads only what it holds
            source = PretrainedSource.open(config.model.init_from)
            with master_window(self.model):  # bf16 parameters: into their fp32 masters
                load_local_shards(self.model, source, self.ep)
            if self.zero is not None:
                self.zero.masters_from_parameters()
            self.pretrained_bytes_read = source.bytes_read
        self.loss_fn = self.tp.loss if self.tp is not None else cross_entropy
        if self.pipeline.vocab is not None:  # vocabulary-parallel over pp
            self.loss_fn = vocab_pipeline.cross_entropy  # also reduces a shard's ShardedLogits
        # Mixture of experts: the load-balancing loss joins the objective with its coefficient.
        self.aux_coef = self.args.aux_loss_coef if self.args.n_experts > 0 else 0.0
        # Documents (pack, varlen): MoE's balancing loss is a sum over tokens, scaled per step
        # as the cross entropy is (``_per_token_scale``); this is that step's factor.
        self.aux_step_scale: torch.Tensor | None = None
        if self.aux_coef and config.data.packing == "concat":
            # Only the last stage holds the loss: each MoE layer adds its balancing loss's
            # gradient in backward, scaled as the one-process objective scales it.
            set_aux_loss_backward_scale(self.model, self.aux_coef / lay.microbatches)

        opt = config.optim
        self.optimizer = build_optimizer(self.model, lr=opt.lr, weight_decay=opt.weight_decay,
                                         betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                         zero=self.zero)
        self.scheduler = build_scheduler(self.optimizer, total_steps=tr.steps,
                                         warmup_steps=opt.warmup_steps,
                                         min_ratio=opt.min_lr_ratio)
        # Clip, check, step: synchronous, or post-validated (loom/train/post_validation.py)
        self.optimizer_step = optimizer_step_for(
            tr, self.optimizer, self.model, self._pending_mean, tp=self.tp, ep=self.ep,
            zero=self.zero, pp_group=self.pipeline.pp_group,
            norm_is_local=config.parallel.dp_mode != "sync")
        # After any pretrained load: the outer loop's snapshot is the weights it starts from.
        self.outer = self._outer_loop()
        self.expert_compressor = self._expert_compressor()

        self.data = DataFiles.open(data_dir)
        seq_len = config.data.seq_len
        # one token file, a prepared source's ranges, or data.mix's sources (loom/data/loader.py);
        # data.packing = pack: rows of whole documents (loom/data/packing.py)
        self.train_set = self.data.train_set(seq_len, packing=config.data.packing)
        self.val_set = self.data.val_set(seq_len, packing=config.data.packing)
        sampler = self.data.sampler(self.train_set, tr.global_batch_size, tr.seed)
        if config.data.packing == "varlen":  # steps of token budgets (loom/data/varlen.py)
            self.loader = VarlenLoader(self.train_set, sampler, *varlen_budgets(config),
                                       config.data.balance, *self._varlen_data_rank(),
                                       self.ctx.device)
        else:
            self.loader = DistributedLoader(self.train_set, sampler, self.dp_rank,
                                            self.dp_size, self.ctx.device)
        self.step = 0
        self._pending_save = None  # an asynchronous checkpoint being written (checkpoint.py)
        self.skipped_steps = 0

    def _outer_loop(self) -> OuterLoop | None:
        """The outer optimizer across this rank's dp_replicate group (the ranks holding the same
        shard in the other replicas), or None under dp_mode = sync. NoLoCo's pairing is seeded by
        ``train.seed``, so a run and its resume pair the same replicas."""
        par = self.config.parallel
        if par.dp_mode == "sync":
            return None
        # ZeRO-1/2: the slices this rank's optimizer owns (every dp_shard rank holds its
        # replica's whole model; each sends only its slices, and ``train_step`` re-gathers
        # them inside the replica after an outer step)
        params = (self.model.named_parameters() if self.zero is None else
                  [(f"zero.bucket{i}", bucket.shard) for i, bucket in enumerate(self.zero.buckets)])
        return OuterLoop(params,
                         self.meshes.root["dp_replicate"].get_group(), mode=par.dp_mode,
                         outer_steps=par.outer_steps, outer_lr=par.outer_lr,
                         outer_momentum=par.outer_momentum, seed=self.config.train.seed,
                         fragments=par.outer_fragments, co2_gap_penalty=par.co2_gap_penalty,
                         co2_clip=par.co2_clip or None, noloco_consensus=par.noloco_consensus,
                         ledger=self.ledger)

    def _expert_compressor(self) -> GradCompressor | None:
        """Gradient compression of the expert shards, whose gradients take their own reduction
        over the data-parallel ranks outside ep (``_reduce_expert_gradients``): a compressor
        of their own over that group, so that every gradient is compressed, the dense ones by
        the data-parallel reducer's. None without compression, ep, or such ranks."""
        spec = compression_of(self.config)
        no_ep = getattr(self.meshes, "dp_no_ep", None)
        if spec is None or self.ep is None or self.layout.dp_shard > 1 or no_ep is None \
                or no_ep.size() == 1:
            return None
        names = expert_parameter_names(self.model)
        return build_compressor([p for n, p in self.model.named_parameters() if n in names],
                                no_ep.get_group(), no_ep.size(), spec, ledger=self.ledger,
                                axis="dp", seed=self.config.train.seed)

    # -- one step ---------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the next global batch; returns loss, grad norm and lr.

        The schedule runs every microbatch's forward and backward (each stage's data-parallel
        reduction starts within its last backward piece and overlaps what follows); the loss
        arrives on every rank; the clipping norm sums the squares over ``pp`` (each pipeline
        rank owns other weights)."""
        batch = self.loader.next_batch()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = self._run_pipeline(batch, training=True)
        self.pipeline.finish_gradient_reduction()
        self._reduce_expert_gradients()
        metrics = self._optimizer_step(loss_sum)
        if self.outer is not None:  # every H inner steps, the outer step across the replicas
            merged = self.outer.after_inner_step(self.step)
            if merged and self.zero is not None:  # the slices it merged, into every parameter
                self.zero.gather_parameters()
        if self.aux_coef and self.aux_step_scale is not None:  # documents: a token mean
            metrics["moe_aux_loss"] = self._mean_over_dp(self.pipeline.aux_loss
                                                         * self.aux_step_scale)
        elif self.aux_coef:
            n_micro = batch[0].shape[0] // self.config.train.micro_batch_size
            metrics["moe_aux_loss"] = self._mean_over_dp(self.pipeline.aux_loss / n_micro)
        return metrics

    def _optimizer_step(self, loss_sum: torch.Tensor) -> dict[str, float]:
        """Clip, check, apply, on gradients already reduced over the data group. The global
        loss and gradient norm are the same on every rank, so all ranks take the same decision:
        a non-finite step is never applied; with ``train.nonfinite = stop`` the run stops naming
        the step, with ``skip`` the step is counted and skipped (the batch and the LR schedule
        still advance, as in Megatron) until more than ``train.max_skipped_steps`` were: then
        the run stops, naming the field. Synchronous, or post-validated (same result)."""
        lr = self.optimizer.param_groups[0]["lr"]
        with master_window(self.model):  # bf16 parameters: clip and step their fp32 masters
            outcome = self.optimizer_step(loss_sum,
                                          f"at step {self.step + 1} on rank {self.ctx.rank}")
        metrics = {"loss": outcome.loss, "grad_norm": outcome.grad_norm, "lr": lr}
        self.skipped_steps += not outcome.applied
        cap = self.config.train.max_skipped_steps
        if self.skipped_steps > cap:  # every rank counts the same steps: all stop together
            raise FloatingPointError(
                f"{self.skipped_steps} non-finite steps skipped, more than"
                f" train.max_skipped_steps={cap} (the last at step {self.step + 1} on rank"
                f" {self.ctx.rank}); the run stops: lower optim.lr, check the data, or raise"
                f" train.max_skipped_steps")
        if self.skipped_steps:  # shown once there is something to show
            metrics["skipped_steps"] = self.skipped_steps
        self.scheduler.step()
        self.step += 1
        return metrics

    def _shard_sequence(self, inputs: torch.Tensor, targets: torch.Tensor):
        """With cp > 1: this rank's part of every sequence and its global positions (for RoPE);
        the loss over the local tokens, averaged over cp, is the global mean (equal shares)."""
        if self.cp_groups is None:
            return inputs, targets, None

        rank, layout = self.cp_groups.cp_rank, self.cp_groups.layout
        inputs, positions = shard_sequence(inputs, rank, layout)
        targets, _ = shard_sequence(targets, rank, layout)
        return inputs, targets, positions

    def _shard_documents(self, batch: DocumentBatch) -> DocumentBatch:
        """With cp > 1: this rank's part of every document of packed rows or a varlen
        microbatch, cut zig-zag per document and padded to a length common to the cp ranks
        (``loom.parallel.context_documents``); the loss stays the step's token mean, its
        token count taken from the shards' targets over dp x cp. ``data.balance = zeppelin``:
        the microbatch's documents placed over the cp ranks instead, each whole on a rank or
        zig-zag over a group (``loom.parallel.zeppelin_cp``)."""
        if self.cp_groups is None:
            return batch
        if self.config.data.balance == "zeppelin":
            costs = model_token_costs(model_args(self.config))
            return take_shard(batch, zeppelin_shard_indices(
                batch.document_ids, self.cp_groups.layout.ring, self.cp_groups.cp_rank, costs,
                self.layout.cp, self.config.data.zeppelin_remap))
        return shard_documents(batch, self.cp_groups.cp_rank, self.cp_groups.layout)

    def _compute_context(self) -> contextlib.AbstractContextManager:
        """Entered around every forward and backward piece: DTensor's (tensor-parallel)
        collectives counted into the ledger, saved activations offloaded to the host, and on an
        emulated slower node (``loom.emulate``) the piece stretched to its speed."""
        stack = contextlib.ExitStack()
        if self.tp is not None and self.ledger is not None:
            stack.enter_context(self.tp.counting())
        stack.enter_context(activation_offload(self.offload))
        if self.ctx.compute_speed < 1:
            stack.enter_context(slowed_to(self.ctx.compute_speed, self.ctx.device))
        return stack

    def _reduce_expert_gradients(self) -> None:
        """Expert shards: summed over dp outside ep and cp, divided by dp x ep x cp (the dense
        parameters were averaged by the data-parallel reducer). Under ZeRO (dp_shard > 1) the
        sharded reduction already gave both kinds their divisor."""
        if self.ep is None or self.layout.dp_shard > 1:
            return
        # an outer mode averages inside a replica: dp_shard = 1 there (config rules), so only cp
        no_ep = self.meshes.dp_no_ep if self.config.parallel.dp_mode == "sync" else None
        # the cp axis's own group: Zeppelin's dp x cp domain (``cp_groups`` when placed over
        # dp) spans ep too, whose ranks hold different experts
        cp = self.meshes.root.get_group("cp") if self.layout.cp > 1 else None
        reduce_gradients(self.model, self.ep, dense=False,
                         dp_group=no_ep.get_group() if no_ep is not None else None,
                         cp_group=cp, compressor=self.expert_compressor)

    def _run_pipeline(self, batch: tuple[torch.Tensor, ...], *,
                      training: bool) -> torch.Tensor:
        """The summed loss of the rank's batch (inputs, targets, or a ``DocumentBatch``) through
        the pipeline, scaled so that its mean over the data-parallel ranks is the step's loss:
        each microbatch's mean divided by their number; for packed rows each microbatch's sum
        over its real tokens, divided by the step's real tokens (all ranks) and multiplied by
        the ranks the mean is over, so padding and uneven documents weigh nothing."""
        if self.config.train.fp8_all_gather:
            # the float8 gathers' scales from the weights as they are now (one all-reduce): also
            # right after an optimizer, outer or checkpoint step, and for evaluation
            precompute_all_gather_scales(self.model)
        if isinstance(batch, VarlenBatch):
            return self._run_varlen(batch, training=training)
        if isinstance(batch, DocumentBatch):  # cp: this rank's part of every document
            batch = self._shard_documents(batch)
        inputs, targets = batch[0], batch[1]
        micro = self.config.train.micro_batch_size
        n_micro = inputs.shape[0] // micro
        schedule = self.pipeline.schedule if training else forward_only(self.pipeline.schedule)
        positions = None  # documents: sharded above, their positions travel with them
        if not isinstance(batch, DocumentBatch):
            inputs, targets, positions = self._shard_sequence(inputs, targets)
        for stage in self.pipeline.stages.values():  # this rank's cp shard of every sequence
            stage.positions = positions
        wire_seq = inputs.shape[1]  # what travels between stages: the cp shard ...
        if self.tp is not None and self.tp.sequence_parallel:
            wire_seq //= self.tp.mesh.size()  # ... and, under SP, this tp rank's part of it
        loss_fn, documents = self.loss_fn, None
        if isinstance(batch, DocumentBatch):
            documents = list(zip(batch.positions.split(micro), batch.document_ids.split(micro)))
            scale = self._per_token_scale((targets != IGNORE_INDEX).sum(), training)

            def scaled(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return loss_fn(logits, y, reduction="sum") * scale
        else:
            def scaled(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return loss_fn(logits, y) / n_micro
        return self.pipeline.step(
            inputs.split(micro), targets.split(micro), scaled, schedule=schedule,
            training=training, activation_shape=(micro, wire_seq, self.args.dim),
            documents=documents)

    def _run_varlen(self, batch: VarlenBatch, *, training: bool) -> torch.Tensor:
        """``_run_pipeline`` for varlen microbatches (``loom.data.varlen``: rows ``[1, T_m]``,
        no padding): each microbatch's summed loss divided by the step's predictions over the
        data ranks averaged together (one scalar all-reduce) and multiplied by their count, so
        the reducer's mean is the mean over every prediction of the step; the receive buffers
        take each microbatch's own length."""
        schedule = self.pipeline.schedule if training else forward_only(self.pipeline.schedule)
        if self.placed_over_dp:  # every domain rank's i-th microbatch, merged (zeppelin_cp)
            batch = merge_dp_microbatches(batch, self.grid.degree(*self.domain_axes))
        micro = [self._shard_documents(mb) for mb in batch.microbatches]
        # cp pads a microbatch's shards (IGNORE_INDEX targets): count the predictions only
        tokens = sum((mb.targets != IGNORE_INDEX).sum() for mb in micro).to(self.ctx.device)
        scale = self._per_token_scale(tokens, training)
        loss_fn = self.loss_fn

        def scaled(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_fn(logits, y, reduction="sum") * scale
        return self.pipeline.step(
            [mb.inputs for mb in micro], [mb.targets for mb in micro], scaled,
            schedule=schedule, training=training,
            activation_shapes=[(1, self._wire_length(mb.inputs.shape[1]), self.args.dim)
                               for mb in micro],
            documents=[(mb.positions, mb.document_ids) for mb in micro])

    def _varlen_data_rank(self) -> tuple[int, int]:
        """The (dp rank, dp size) a varlen loader deals for: where a domain of dp x cp ranks
        places merged microbatches (``_run_varlen`` merges them), every bin of the domain's
        share of the step (the whole step; a replica's under an outer dp_mode), else this dp
        rank's share."""
        if not self.placed_over_dp:
            return self.dp_rank, self.dp_size
        outside = [axis for axis in DATA_AXES if axis not in self.domain_axes]
        return self.grid.index(self.ctx.rank, *outside), self.grid.degree(*outside)

    def _wire_length(self, length: int) -> int:
        """The sequence length a microbatch of ``length`` tokens travels between stages with:
        under SP this tp rank's shard, uneven when tp does not divide it (varlen)."""
        if self.tp is None or not self.tp.sequence_parallel:
            return length
        return sequence_shard_lengths(length, self.tp.mesh.size())[self.tp.mesh.get_local_rank()]

    def _per_token_scale(self, tokens: torch.Tensor, training: bool) -> torch.Tensor:
        """``dp / (the step's real tokens)``: a microbatch's summed loss times this is its share
        of the step's token mean once the reducer averages over dp. ``tokens`` is this rank's;
        they are summed over the data ranks whose gradients are averaged together (sync: all
        of them; an outer mode: this replica's). MoE's balancing loss with documents is a sum
        over tokens too (``loom.models.moe``): its gradient gets the same factor times its
        coefficient, so it is also a token mean over the step, whatever the layout."""
        if self.token_group_size > 1:
            comm.all_reduce(tokens, self.token_group, axis="dp", ledger=self.ledger)
        scale = self.token_group_size / tokens.clamp(min=1)
        if self.aux_coef and training:
            # one host sync per step: the layers take a plain factor
            set_aux_loss_backward_scale(self.model, self.aux_coef * float(scale))
            self.aux_step_scale = scale
        return scale

    def _pending_mean(self, value: torch.Tensor) -> PendingMean:
        """The mean of a per-rank loss over the ranks that hold different data (dp, and cp),
        all-reduced in the background."""
        axis = "dp_cp" if self.cp_groups is not None else "dp"
        return PendingMean(value, self.loss_group, self.loss_group_size, axis=axis,
                           ledger=self.ledger)

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        return self._pending_mean(value).result()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first ``train.eval_batches`` global batches of the validation split."""
        tr = self.config.train
        if self.config.data.packing == "varlen":
            batches = varlen_eval_batches(self.val_set, *varlen_budgets(self.config),
                                          self.config.data.balance, tr.eval_batches,
                                          *self._varlen_data_rank(), self.ctx.device)
        else:
            batches = eval_batches(self.val_set, tr.global_batch_size, tr.eval_batches,
                                   self.dp_rank, self.dp_size, self.ctx.device)
        # forward-only through the stages, the loss shared over pp
        losses = [self._run_pipeline(batch, training=False) for batch in batches]
        if not losses:
            return math.nan
        return self._mean_over_dp(torch.stack(losses).mean())

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The training state beyond the weights: step, optimizer, LR schedule and data position."""
        return {"step": self.step, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "data": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` output (weights are loaded separately)."""
        self.step = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])

    # -- checkpoints (loom.train.checkpointing) ------------------------------------------------
    def save_checkpoint(self, root: Path | None = None) -> Path:
        """Save the full training state as checkpoint ``step`` under ``root`` (collective).
        With ``checkpoint.async_save`` the write continues in the background (one at a time:
        this first waits for the previous one); the returned path exists once it is committed."""
        return checkpointing.save(self, root or self.run_dir / "checkpoints")

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the background checkpoint write (if any) is written and committed."""
        pending, self._pending_save = self._pending_save, None
        return pending.wait() if pending is not None else None

    def load_checkpoint(self, path: Path, *, verified: bool = False) -> None:
        """Continue from a checkpoint saved under this or any other layout (collective);
        ``verified``: rank 0 has just verified it (``checkpoint.load`` does not hash it again)."""
        checkpointing.load(self, path, verified=verified)

    def resume(self, spec: str, log=print) -> Path | None:
        """``spec`` is ``auto`` (the newest checkpoint of this run that is complete and valid;
        none: refuse, naming the ones skipped), ``auto_or_fresh`` (the same, but none: start
        from step 0) or a checkpoint directory. Refused checkpoints are logged, never loaded."""
        return checkpointing.resume(self, spec, log)

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient by its model name (for parity tests); a collective:
        call it on every rank (``loom.train.full_state``)."""
        return full_state.named_gradients(self)

    def save_weights(self, path: Path) -> None:
        """The full model weights as safetensors (``loom.train.full_state``; every rank calls);
        bf16 parameters without ZeRO: their fp32 masters (ZeRO-1/2: the bf16 values)."""
        with master_window(self.model):
            full_state.save_weights(self, path)

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train ``train.steps`` steps with logging and evaluation; save the final weights.

        A stop request (SIGTERM on any rank, ``loom.train.preempt``; ``request_stop``) ends the
        loop early at a step all ranks agree on, with a checkpoint instead of final weights; the
        returned metrics then hold ``preempted_step``. While it runs, a ``CollectiveWatch``
        records this rank's collectives, so a timeout names the rank that never arrived."""
        cfg, tr = self.config, self.config.train
        tokens_per_step = tr.global_batch_size * cfg.data.seq_len
        varlen = cfg.data.packing == "varlen"  # a step's tokens vary (loom/data/varlen.py)
        compute_dtype = torch.bfloat16 if tr.dtype in ("bf16", "bf16_autocast") else torch.float32
        mc = cfg.metrics
        # a stated peak or none (MFU n/a): loom/train/flops.py
        peak, peak_source = device_peak_flops(self.ctx.device, compute_dtype, mc.peak_tflops)
        flops = model_flops_per_token(self.args, cfg.data.seq_len)  # MoE: active experts
        timer = StepTimer(flops_per_token=flops, peak_flops=peak, n_devices=self.ctx.world_size,
                          device=self.ctx.device)
        logger = MetricsLogger(self.run_dir, is_main=self.ctx.is_main, jsonl=mc.jsonl,
                               tensorboard=mc.tensorboard, progress=mc.progress,
                               total_steps=tr.steps, log_every=mc.log_every, peak_flops=peak,
                               trackers=open_trackers(cfg, self.run_dir, self.ctx.is_main))
        logger.log_text(f"{describe_grid(self.grid)}\nmodel:"
                        f" {sum(p.numel() for p in self.model.parameters()):,} parameters; device"
                        f" {self.ctx.device} ({self.ctx.backend});"
                        f" {describe_peak(peak, peak_source)}")
        if isinstance(self.pipeline, PathPipeline):  # skippipe: the paths and their plan
            logger.log_text(self.pipeline.describe())
        if self.outer is not None:
            par = cfg.parallel
            logger.log_text(f"outer loop: {par.dp_mode} across dp_replicate = {par.dp_replicate}"
                            f" replicas, H = {par.outer_steps}, outer lr {par.outer_lr},"
                            f" {'Nesterov' if self.outer.nesterov else 'heavy-ball'}"
                            f" momentum {par.outer_momentum}")
        last: dict[str, float] = {}
        ck = cfg.checkpoint
        watch = self._collective_watch()  # names a hung rank when a collective times out
        profiler = StepProfiler(mc.profile_steps, self.run_dir, self.ctx.rank, self.ctx.device,
                                log=logger.log_text)  # metrics.profile_steps: Chrome traces
        with logger, watch or contextlib.nullcontext(), profiler:
            try:
                for note in self.offload.notes:
                    logger.log_text(note)
                if ck.resume and self.run_dir is not None:
                    self.resume(ck.resume, log=logger.log_text)
                while self.step < tr.steps:
                    if watch is not None:
                        watch.set_step(self.step + 1)
                    profiler.begin(self.step + 1)
                    timer.start()
                    last = self.train_step()
                    timing = timer.stop(self.loader.last_step_tokens if varlen
                                        else tokens_per_step)
                    profiler.end(self.step)
                    last.update(timing.as_dict(), peak_mem_bytes=peak_memory_bytes(self.ctx.device))
                    if self.ledger is not None:  # this step's collectives, per axis and op
                        last.update(self.ledger.summary())
                        self.ledger.reset()
                    logger.log_step(self.step, last)
                    if tr.eval_every and (self.step % tr.eval_every == 0 or self.step == tr.steps):
                        last["val_loss"] = self.evaluate()
                        logger.log_eval(self.step, {"loss": last["val_loss"]})
                    saved = None
                    if self.run_dir is not None and ck.interval and self.step % ck.interval == 0:
                        saved = self.save_checkpoint()
                    # SIGTERM on any rank: all stop here, at the same step (one all-reduce).
                    if self.step < tr.steps and self._stop_agreed():
                        last["preempted_step"] = self.step
                        self._stop_for_preemption(saved, logger.log_text, watch)
                        break
                if self.outer is not None:  # co2's last all-reduce lands before the group ends
                    self.outer.finish()
                if self.run_dir is not None and "preempted_step" not in last:
                    if ck.interval and self.step % ck.interval:  # the end, unless just saved
                        self.save_checkpoint()
                    self.wait_for_checkpoint()  # an asynchronous save is committed before exit
                    self.save_weights(self.run_dir / "model.safetensors")
            except Exception as err:
                hung = watch.hung_error(err) if watch is not None else None
                if hung is not None:  # a collective timed out: name who never arrived
                    raise hung from err
                raise
            logger.close(plot=mc.plot)
        return last

    # -- preemption and hangs ---------------------------------------------------------------------
    def request_stop(self) -> None:
        """Checkpoint and leave ``fit`` after the current step, as a SIGTERM does (any one rank
        asking is enough: ``fit`` agrees on the step with the others)."""
        self._stop_requested = True

    def _stop_agreed(self) -> bool:
        """True on every rank when any rank asked to stop (one 1-element all-reduce per step)."""
        local = getattr(self, "_stop_requested", False) or preempt.stop_requested()
        return preempt.agree_to_stop(local, self.ctx.device)

    def _stop_for_preemption(self, saved: Path | None, log, watch) -> Path | None:
        """Checkpoint this step to ``run_dir/checkpoints`` (unless the interval just did), wait
        for it to be committed, log where it is; ``--resume auto`` then continues bit for bit."""
        if self.run_dir is None:
            log(f"preempted at step {self.step}: no run directory, nothing saved")
            return None
        path = saved or self.save_checkpoint()
        self.wait_for_checkpoint()
        if watch is not None:
            watch.set_status("preempted")
        log(f"preempted at step {self.step}: checkpoint saved to {path},"
            " resume with --resume auto")
        return path

    def _collective_watch(self):
        """This rank's ``CollectiveWatch`` (``loom.train.watchdog``), None without a run dir."""
        if self.run_dir is None:
            return None

        return CollectiveWatch(self.run_dir, self.ctx.rank, self.config.train.timeout_s,
                               self._group_names())

    def _group_names(self) -> dict[str, str]:
        """Process-group name -> axis name, for messages about collectives ('dp', 'tp', ...)."""
        names: dict[str, str] = {}

        def add(label: str, group) -> None:
            name = getattr(group, "group_name", None)
            if name is not None:
                names.setdefault(str(name), label)

        meshes = self.meshes
        for label in ("dp", "dp_cp", "dp_no_ep", "dp_shard_cp", "dp_shard_ep"):
            mesh = getattr(meshes, label, None)
            if mesh is not None and mesh.ndim == 1:
                add(label, mesh.get_group())
        for axis in meshes.root.mesh_dim_names or ():
            add(axis, meshes.root.get_group(axis))
        add("pp", self.pipeline.pp_group)
        if self.cp_groups is not None and getattr(self.cp_groups, "cp", None) is not None:
            add("cp", self.cp_groups.cp)
        return names
