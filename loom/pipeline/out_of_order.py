"""CheckFree+'s out-of-order pipelining: every other microbatch runs the first two and the last
two stages' blocks in swapped order, so the second (second-to-last) stage learns to act as the
first (last) one and can stand in for it when it is lost.

Blagoev, Ersoy and Chen, "All is Not Lost: LLM Recovery without Checkpoints" (arXiv
2506.15461), CheckFree+: a lost first or last stage has only one neighbour, so the neighbour
average of CheckFree cannot rebuild it; instead training itself makes the neighbour a stand-in.
In the authors' public code (``gensyn-ai/CheckFree``, ``simulate_training``) the microbatches
with an odd index within a step (half of them) run the first two transformer stages in swapped
order and the last two in swapped order; the embedding and the output layer stay where they are
(their code keeps them in a separate stage). Here stage 0 also holds the embedding and stage
``pp - 1`` the final norm and head, so a microbatch's *visits* are

    in order      (0, embed) (0, blocks) (1, blocks) ... (pp-2, blocks) (pp-1, blocks) (pp-1, head)
    out of order  (0, embed) (1, blocks) (0, blocks) ... (pp-1, blocks) (pp-2, blocks) (pp-1, head)

i.e. an out-of-order microbatch goes rank 0 -> 1 -> 0 -> 2 -> ... -> pp-3 -> pp-1 -> pp-2 ->
pp-1. The swaps need ``pp >= 4`` (at pp = 3 the two pairs would share the middle stage).
Evaluation runs every microbatch in order (the authors' validation does).

The runtime (``OutOfOrderPipeline``) runs these visits on one rank per stage, GPipe style: every
rank walks its visits of all microbatches in (microbatch, visit) order for the forward, then in
(microbatch, reversed visit) order for the backward, with blocking receives and asynchronous
sends. Each rank's order is the restriction of one global order in which every visit comes after
the one it depends on, so the walk cannot deadlock. Visits that follow each other on the same
rank hand the tensor over locally; every visit boundary is a detached leaf, so each visit's
backward is its own. Each microbatch's loss is already divided by the number of microbatches
(the trainer's convention), so the accumulated gradients are the batch's.

Why hand-written: ``loom.pipeline.runtime`` interprets schedules in which every microbatch
visits each stage once in stage order, and ``loom.pipeline.paths_runtime`` (SkipPipe) runs a
stage's whole slice per visit; here a rank is visited twice by the same microbatch, once for its
end (embedding or head) and once for its blocks, in an order that depends on the microbatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loom.layout import Job
from loom.parallel import comm, parallelize
from loom.parallel.comm import CommLedger
from loom.pipeline.partition import partition_model
from loom.pipeline.stage import LossFn, PipelineStage, build_stages
from loom.pipeline.transfers import ACTIVATION, GRADIENT, WIRE_DTYPE
from loom.schedule.ir import Schedule
from loom.topology import Meshes, RankGrid

EMBED, BLOCKS, HEAD = "embed", "blocks", "head"
MIN_STAGES = 4  # two disjoint swapped pairs: (0, 1) and (pp-2, pp-1)


@dataclass(frozen=True)
class Visit:
    """One piece of a microbatch's way through the pipeline: ``part`` of stage ``stage``."""
    stage: int
    part: str  # EMBED (stage 0), BLOCKS (any stage), HEAD (the last stage: norm, head, loss)


def is_swapped(microbatch: int) -> bool:
    """Whether microbatch ``microbatch`` (its index within the step) runs out of order: the odd
    ones, half of every step (the authors' code: ``mbid % 2 == 1``)."""
    if microbatch < 0:
        raise ValueError(f"microbatch index must be >= 0, got {microbatch}")
    return microbatch % 2 == 1


def block_order(num_stages: int, microbatch: int, *, out_of_order: bool = True) -> tuple[int, ...]:
    """The order in which the stages' blocks process ``microbatch``: ``0 .. pp-1``, or with the
    first two and the last two swapped when ``out_of_order`` and ``is_swapped(microbatch)``."""
    if num_stages < MIN_STAGES:
        raise ValueError(f"out-of-order pipelining swaps stages (0, 1) and (pp-2, pp-1), which"
                         f" needs pp >= {MIN_STAGES}; got pp = {num_stages}")
    order = list(range(num_stages))
    if out_of_order and is_swapped(microbatch):
        order[0], order[1] = order[1], order[0]
        order[-2], order[-1] = order[-1], order[-2]
    return tuple(order)


def visits(num_stages: int, microbatch: int, *, out_of_order: bool = True) -> tuple[Visit, ...]:
    """Every visit of ``microbatch`` in order: the embedding, each stage's blocks in
    ``block_order``, the head."""
    order = block_order(num_stages, microbatch, out_of_order=out_of_order)
    return (Visit(0, EMBED), *(Visit(s, BLOCKS) for s in order), Visit(num_stages - 1, HEAD))


def run_part(module: nn.Module, part: str, h: torch.Tensor) -> torch.Tensor:
    """Apply one part of a stage's ``Transformer`` slice: the embedding (token ids in), its
    blocks in layer order, or the final norm and head (logits out)."""
    if part == EMBED:
        return module.tok_embeddings(h)
    if part == HEAD:
        return module.output(module.norm(h))
    if part != BLOCKS:
        raise ValueError(f"unknown part {part!r}: one of {EMBED}, {BLOCKS}, {HEAD}")
    cos, sin = module.rope_cos[: h.shape[1]], module.rope_sin[: h.shape[1]]
    for layer in module.layers.values():
        h = layer(h, cos, sin)
    return h


class OutOfOrderPipeline:
    """What the trainer asks of a pipeline (``loom.pipeline.runtime.PipelineRuntime``'s face)
    for ``fault.recovery = checkfree_plus``: this rank's one stage, run along ``visits``
    (module docstring). ``ranks[s]`` is the global rank of stage s; ``group`` joins them.
    ``schedule`` is the one-stage-per-rank schedule the estimator prices; ``step`` uses it
    only to tell training from evaluation."""

    aux_loss = None  # dense models only (the config refuses experts: ep = 1)
    reducers: dict = {}
    vocab = None  # no vocabulary shard (the config refuses vocab_parallel_pp with CheckFree)

    def __init__(self, stage: PipelineStage, ranks: Sequence[int], group: dist.ProcessGroup,
                 schedule: Schedule, *, ledger: CommLedger | None = None,
                 compute_context: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext) -> None:
        if len(ranks) != stage.num_stages:
            raise ValueError(f"{len(ranks)} ranks for {stage.num_stages} stages")
        block_order(stage.num_stages, 0)  # refuses pp < 4
        self.stage, self.ranks, self.pp_group = stage, tuple(ranks), group
        self.pp_ranks, self.pp_rank = self.ranks, stage.model_stage
        self.stages = {stage.model_stage: stage}
        self.schedule = schedule
        self.ledger, self.compute_context = ledger, compute_context

    def route_replicas(self) -> list[nn.Module]:
        return []

    def finish_gradient_reduction(self) -> None:
        """Nothing to reduce: one rank per stage, and every microbatch visits every stage."""

    def _tag(self, microbatch: int, visit: int, direction: int) -> int:
        return (microbatch * (self.stage.num_stages + 2) + visit) * 2 + direction

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
             loss_fn: LossFn, *, schedule: Schedule | None = None, training: bool = True,
             activation_shape: Sequence[int], documents=None) -> torch.Tensor:
        """Forward (and with ``training`` backward) every microbatch along its visits, out of
        order in training, in order otherwise; returns the summed loss, the same on every
        rank. ``loss_fn`` is already scaled (1 / number of microbatches)."""
        if documents is not None:  # the config refuses packing for checkfree_plus
            raise ValueError("checkfree_plus runs concatenated rows only (data.packing = concat)")
        stage, me = self.stage, self.stage.model_stage
        module, device = stage.module, stage.module.rope_cos.device
        plans = [visits(stage.num_stages, m, out_of_order=training) for m in range(len(inputs))]
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        local: dict[tuple[int, int, int], torch.Tensor] = {}  # (mb, visit, dir) -> handed over
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # leaf in, out
        loss_sum = torch.zeros((), device=device)

        def receive(m: int, v: int, direction: int, peer_visit: Visit) -> torch.Tensor:
            if peer_visit.stage == me:
                return local.pop((m, v, direction))
            buffer = torch.empty(tuple(activation_shape), dtype=WIRE_DTYPE, device=device)
            comm.irecv(buffer, self.ranks[peer_visit.stage], self.pp_group, axis="pp",
                       ledger=self.ledger, tag=self._tag(m, v, direction)).wait()
            return buffer

        def hand_over(m: int, v: int, direction: int, peer_visit: Visit,
                      tensor: torch.Tensor) -> None:
            payload = tensor.detach().to(WIRE_DTYPE).contiguous()
            if peer_visit.stage == me:
                local[(m, v, direction)] = payload
                return
            work = comm.isend(payload, self.ranks[peer_visit.stage], self.pp_group, axis="pp",
                              ledger=self.ledger, tag=self._tag(m, v, direction))
            sends.append((work, payload))

        for m, plan in enumerate(plans):  # forward, in (microbatch, visit) order
            for v, visit in enumerate(plan):
                if visit.stage != me:
                    continue
                if visit.part == EMBED:
                    h = inputs[m]
                else:
                    h = receive(m, v, ACTIVATION, plan[v - 1])
                    if training:
                        h = h.detach().requires_grad_(True)
                grad_mode = contextlib.nullcontext() if training else torch.no_grad()
                with self.compute_context(), grad_mode, stage.autocast():
                    out = run_part(module, visit.part, h)
                if visit.part == HEAD:
                    out = loss_fn(out, targets[m])
                    loss_sum = loss_sum + out.detach().float()
                else:
                    hand_over(m, v + 1, ACTIVATION, plan[v + 1], out)
                if training:
                    held[(m, v)] = (h, out)
        if training:  # backward, in (microbatch, reversed visit) order
            for m, plan in enumerate(plans):
                for v in reversed(range(len(plan))):
                    visit = plan[v]
                    if visit.stage != me:
                        continue
                    h, out = held.pop((m, v))
                    grad = None
                    if visit.part != HEAD:
                        grad = receive(m, v, GRADIENT, plan[v + 1]).to(out.dtype)
                    with self.compute_context():
                        torch.autograd.backward(out, grad)
                    if visit.part != EMBED:
                        hand_over(m, v - 1, GRADIENT, plan[v - 1], h.grad)
        for work, _ in sends:
            work.wait()
        if local:
            raise RuntimeError(f"stage {me}: hand-overs left unread: {sorted(local)}")
        comm.all_reduce(loss_sum, self.pp_group, axis="pp", ledger=self.ledger)
        return loss_sum


def build_out_of_order_pipeline(job: Job, schedule: Schedule, *, grid: RankGrid, meshes: Meshes,
                                rank: int, device: torch.device,
                                autocast: Callable[[], contextlib.AbstractContextManager]
                                | None = None, ledger: CommLedger | None = None,
                                compute_context: Callable[[], contextlib.AbstractContextManager]
                                = contextlib.nullcontext) -> OutOfOrderPipeline:
    """This rank's stage of ``job`` (one stage per rank under ``schedule``, seeded by name as
    every pipeline builds it) and the out-of-order runtime over the ``pp`` group."""
    if job.args.tie_embeddings:
        raise ValueError("checkfree_plus does not train tied embeddings: the head's copy on the"
                         " last stage would need the first stage's gradient")
    layers = partition_model(job.args, schedule.stages_per_route, job.seq_len)
    pp_rank = grid.coords(rank)["pp"]
    kwargs = {"autocast": autocast} if autocast is not None else {}
    stages = build_stages(job.args, schedule, layers, pp_rank, device, job.seed, **kwargs)
    if len(stages) != 1:
        raise ValueError(f"checkfree_plus runs one stage per rank; schedule"
                         f" {schedule.name!r} places {len(stages)} on rank {pp_rank}")
    (stage,) = stages.values()
    stage.applied = parallelize(stage.module, meshes, job, ledger=ledger)
    stage.module = stage.applied.module
    return OutOfOrderPipeline(stage, grid.group(rank, "pp"), meshes.root["pp"].get_group(),
                              schedule, ledger=ledger, compute_context=compute_context)


__all__ = ["BLOCKS", "EMBED", "HEAD", "MIN_STAGES", "OutOfOrderPipeline", "Visit",
           "block_order", "build_out_of_order_pipeline", "is_swapped", "run_part", "visits"]
