"""Run microbatch paths (SkipPipe, issue 18) on pp x R ranks: one stage replica per rank.

``loom.schedule.paths`` says which stages each microbatch visits, in which order, and which
replica runs each visit; this module runs that on real ranks:

* Ranks. Stage s, replica r is global rank ``ranks[s * R + r]`` (pp outer, replicas inner: the
  rank grid's order for ``pp`` x ``dp_replicate``), so the replicas of a stage are a data
  parallel group of the grid. Each rank holds one ``PipelineStage``: its layers, the embedding on
  stage 0, the final norm, head and loss on the last stage.
* Routing. Visit k of microbatch m sends its output to the rank of visit k+1 and, backward, its
  input gradient to the rank of visit k-1: whichever stages those are, skipped stages and swaps
  included. A middle stage does not care where its input came from. Messages are fp32
  ``[micro, seq, dim]`` with tag ``(stage·M + m)·2 + direction`` of the receiving stage (a path
  visits a stage once, so every message of a step has its own tag).
* Order. Each rank runs its forwards and backwards in the order of a replay of the paths
  (``loom.schedule.path_replay.execution_orders``): the replay is one execution that respects
  every dependency, so with asynchronous sends and receives posted a few actions ahead nothing
  can deadlock.
* Gradients. A replica accumulates the gradients of exactly the microbatches that visited it
  (each microbatch's loss already divided by the batch's microbatch count). Then
  ``finish_gradient_reduction`` sums them over the stage's replicas (one flat all-reduce over
  the stage group, axis ``stage_replicas``): every replica ends with the stage's gradient over
  the whole batch, i.e. the average over replicas of what each would get from its own share,
  scaled to the batch, and identical optimizer steps keep the replicas equal.
* Loss. The last stage's replicas compute the losses; one scalar all-reduce over all ranks makes
  every rank report the batch's.

Hand-written: ``torch.distributed.pipelining`` has no notion of a microbatch taking its own
route through stage replicas. Written beside ``loom.pipeline.runtime`` rather than inside it: that interpreter walks a
``Schedule`` of actions over a placement where every microbatch visits the same stages; a path
set has neither (one rank per stage replica, each microbatch its own route), and keeping the
two apart leaves the ordinary pipeline untouched. Tied embeddings, tensor / context / expert
parallelism and ZeRO inside a replica are not supported here yet (``build_path_stage`` refuses a
tied model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loom.cluster import Cluster, Link, Node
from loom.layout import Job
from loom.models import TransformerArgs, build_model, reset_parameters
from loom.parallel import Parallelized, comm
from loom.parallel.comm import CommLedger
from loom.pipeline.partition import partition_model
from loom.pipeline.stage import LossFn, PipelineStage
from loom.schedule.path_replay import BACKWARD, FORWARD, PathCosts, Task, execution_orders
from loom.schedule.path_search import PathScheduler
from loom.schedule.paths import PathSet, full_paths, skip_count
from loom.schedule.select import schedule_of
from loom.topology import Meshes, RankGrid

ACTIVATION, GRADIENT = 0, 1
WIRE_DTYPE = torch.float32


def build_path_stage(args: TransformerArgs, num_stages: int, stage: int,
                     layers: Sequence[range], device: torch.device | str, seed: int,
                     autocast: Callable[[], contextlib.AbstractContextManager]
                     = contextlib.nullcontext) -> PipelineStage:
    """Stage ``stage`` of ``num_stages`` with ``layers[stage]``, initialised by name like the
    whole model (every replica of a stage starts identical)."""
    if args.tie_embeddings and num_stages > 1:
        raise ValueError("skippipe does not train tied embeddings yet: the head's copy on the "
                         "last stage would need the first stage's gradient")
    module = build_model(args, device="meta", layer_ids=layers[stage],
                         with_embedding=stage == 0, with_head=stage == num_stages - 1)
    module.to_empty(device=device)
    reset_parameters(module, seed)
    return PipelineStage(stage, num_stages, module, autocast)


@dataclass(frozen=True)
class _Message:
    stage: int  # the receiving stage
    microbatch: int
    direction: int
    peer: int  # global rank of the other side

    def tag(self, num_microbatches: int) -> int:
        return (self.stage * num_microbatches + self.microbatch) * 2 + self.direction


class PathRuntime:
    """Runs ``paths`` on this rank's ``stage`` (a ``PipelineStage``), which is replica
    ``replica``. ``ranks[s * R + r]`` is the global rank of stage s replica r; ``group`` joins
    them all (None: the default group); ``stage_group`` joins this stage's replicas (None when
    R = 1)."""

    def __init__(self, paths: PathSet, stage: PipelineStage, replica: int, ranks: Sequence[int],
                 group: dist.ProcessGroup | None = None,
                 stage_group: dist.ProcessGroup | None = None, *,
                 orders: dict[tuple[int, int], list[Task]] | None = None,
                 ledger: CommLedger | None = None, recv_lookahead: int = 4,
                 compute_context: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext) -> None:
        if len(ranks) != paths.num_stages * paths.num_replicas:
            raise ValueError(f"{len(ranks)} ranks for {paths.num_stages} stages x "
                             f"{paths.num_replicas} replicas")
        self.paths, self.stage, self.replica = paths, stage, replica
        self.ranks, self.group, self.stage_group = tuple(ranks), group, stage_group
        self.orders = orders if orders is not None else execution_orders(paths)
        self.ledger, self.recv_lookahead = ledger, recv_lookahead
        # entered around each forward and backward (not the waits): the trainer's emulated
        # node speed and activation offload, as in the pipeline interpreter
        self.compute_context = compute_context

    def rank_of(self, stage: int, replica: int) -> int:
        return self.ranks[stage * self.paths.num_replicas + replica]

    def _incoming(self, task: Task) -> _Message | None:
        path = self.paths.paths[task.microbatch].visits
        if task.op == FORWARD and task.index > 0:
            prev = path[task.index - 1]
            return _Message(path[task.index].stage, task.microbatch, ACTIVATION,
                            self.rank_of(prev.stage, prev.replica))
        if task.op == BACKWARD and task.index + 1 < len(path):
            nxt = path[task.index + 1]
            return _Message(path[task.index].stage, task.microbatch, GRADIENT,
                            self.rank_of(nxt.stage, nxt.replica))
        return None

    def _outgoing(self, task: Task) -> _Message | None:
        path = self.paths.paths[task.microbatch].visits
        if task.op == FORWARD and task.index + 1 < len(path):
            nxt = path[task.index + 1]
            return _Message(nxt.stage, task.microbatch, ACTIVATION,
                            self.rank_of(nxt.stage, nxt.replica))
        if task.op == BACKWARD and task.index > 0:
            prev = path[task.index - 1]
            return _Message(prev.stage, task.microbatch, GRADIENT,
                            self.rank_of(prev.stage, prev.replica))
        return None

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
             loss_fn: LossFn, *, activation_shape: Sequence[int],
             training: bool = True) -> torch.Tensor:
        """Run every microbatch's path (forward and, with ``training``, backward) on this rank's
        share; returns the sum of the microbatch losses, the same on every rank. ``loss_fn``
        should already be scaled (e.g. by 1 / number of microbatches)."""
        paths, stage = self.paths, self.stage
        num_microbatches = paths.num_microbatches
        if len(inputs) != num_microbatches:
            raise ValueError(f"{len(inputs)} microbatches for {num_microbatches} paths")
        row = [t for t in self.orders[stage.model_stage, self.replica]
               if training or t.op == FORWARD]
        device = stage.module.rope_cos.device
        posted: dict[_Message, tuple[dist.Work, torch.Tensor]] = {}
        sends: list[dist.Work] = []
        next_to_post = 0
        loss_sum = torch.zeros((), device=device)
        for index, task in enumerate(row):
            while next_to_post < min(len(row), index + 1 + self.recv_lookahead):
                needed = self._incoming(row[next_to_post])
                if needed is not None:
                    buffer = torch.empty(tuple(activation_shape), dtype=WIRE_DTYPE, device=device)
                    work = comm.irecv(buffer, needed.peer, self.group, axis="pp",
                                      ledger=self.ledger, tag=needed.tag(num_microbatches))
                    posted[needed] = (work, buffer)
                next_to_post += 1
            needed = self._incoming(task)
            received = None
            if needed is not None:
                work, received = posted.pop(needed)
                work.wait()
            mb = task.microbatch
            with self.compute_context():
                if task.op == FORWARD:
                    source = inputs[mb] if stage.is_first else received
                    result = stage.forward(mb, source, targets[mb] if stage.is_last else None,
                                           loss_fn if stage.is_last else None,
                                           training=training)
                    if stage.is_last:
                        loss_sum = loss_sum + result.detach().float()
                        result = None
                else:
                    result = stage.backward(mb, received)
            message = self._outgoing(task)
            if message is not None and result is not None:
                payload = result.detach().to(WIRE_DTYPE).contiguous()
                sends.append(comm.isend(payload, message.peer, self.group, axis="pp",
                                        ledger=self.ledger, tag=message.tag(num_microbatches)))
        for work in sends:
            work.wait()
        comm.all_reduce(loss_sum, self.group, axis="pp", ledger=self.ledger)
        return loss_sum

    def finish_gradient_reduction(self, average: bool = False) -> None:
        """Sum this stage's gradients over its replicas (module docstring): one flat
        all-reduce of 4·P_stage bytes over ``stage_group``; nothing at one replica.

        ``average``: divide the sum by R. That is the data-parallel convention, for losses
        scaled by each replica's own share of the microbatches (1 / (M / R), what the trainer's
        per-rank loader gives, ``gather_microbatches``): the average is then the batch's
        gradient too."""
        if self.stage_group is None:
            return
        params = self.stage.parameters()
        for param in params:  # a replica no microbatch visited still joins the sum
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce(flat, self.stage_group, axis="stage_replicas", ledger=self.ledger)
        if average:
            flat /= self.paths.num_replicas
        offset = 0
        for param in params:
            param.grad.copy_(flat[offset:offset + param.numel()].view_as(param.grad))
            offset += param.numel()

    @property
    def module(self) -> nn.Module:
        return self.stage.module


def gather_microbatches(local: Sequence[torch.Tensor], stage_group: dist.ProcessGroup | None,
                        num_replicas: int, ledger: CommLedger | None = None
                        ) -> list[torch.Tensor]:
    """The batch's microbatches from the replicas' shares: this rank's loader gave it
    ``local`` (its replica's share, as a data-parallel rank's), and one all-gather over the
    stage group (axis ``stage_replicas``; every replica of every stage calls it) collects the
    others'. Global microbatch ``j * R + r`` is replica r's j-th, so the first stage's replica r
    feeds its own data (``loom.schedule.paths.first_replica``). Returns ``local`` itself at one
    replica."""
    if num_replicas == 1 or stage_group is None:
        return list(local)
    mine = torch.stack(list(local)).contiguous()
    shares = mine.new_empty((num_replicas, *mine.shape))
    comm.all_gather_into_tensor(shares.view(-1, *mine.shape[1:]), mine, stage_group,
                                axis="stage_replicas", ledger=ledger)
    return [shares[r, j] for j in range(len(local)) for r in range(num_replicas)]


class PathPipeline:
    """What the trainer asks of a pipeline (``loom.pipeline.runtime.PipelineRuntime``'s face),
    for ``parallel.schedule = "skippipe"``: this rank's one stage replica, the training paths
    and full evaluation paths, and the stage group.

    The trainer's loader gives each replica its share of the batch, as to a data-parallel rank
    (dp_replicate = stage_replicas), and scales each loss by that share; ``step`` gathers the
    batch over the stage group (``gather_microbatches``), runs every path, and returns the
    summed loss divided by R, which the trainer's mean over dp leaves as the batch's loss.
    ``finish_gradient_reduction`` averages the replicas' gradients. Evaluation runs the full
    paths (every stage, microbatch m on replica m % R). ``schedule`` is the GPipe schedule the
    estimator prices (``loom.schedule.select.schedule_of``); ``step`` ignores what it is given.
    """

    aux_loss = None  # dense models only (the config refuses experts)
    reducers: dict = {}

    def __init__(self, train: PathRuntime, evaluate: PathRuntime, schedule,
                 pp_group: dist.ProcessGroup | None, pp_ranks: Sequence[int],
                 pp_rank: int) -> None:
        self.train, self.evaluate, self.schedule = train, evaluate, schedule
        self.pp_group, self.pp_ranks, self.pp_rank = pp_group, tuple(pp_ranks), pp_rank
        self.stages = {train.stage.model_stage: train.stage}
        self.replicas = train.paths.num_replicas

    def route_replicas(self) -> list[nn.Module]:
        return []

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
             loss_fn: LossFn, *, schedule=None, training: bool = True,
             activation_shape: Sequence[int], documents=None) -> torch.Tensor:
        if documents is not None:  # the config refuses packing for skippipe
            raise ValueError("skippipe runs concatenated rows only (data.packing = concat)")
        runtime = self.train if training else self.evaluate
        group, ledger = runtime.stage_group, runtime.ledger
        inputs = gather_microbatches(inputs, group, self.replicas, ledger)
        targets = gather_microbatches(targets, group, self.replicas, ledger)
        loss = runtime.step(inputs, targets, loss_fn, activation_shape=activation_shape,
                            training=training)
        return loss / self.replicas

    def finish_gradient_reduction(self) -> None:
        self.train.finish_gradient_reduction(average=True)


def build_path_pipeline(job: Job, skip_ratio: float, *, grid: RankGrid, meshes: Meshes,
                        rank: int, device: torch.device,
                        autocast: Callable[[], contextlib.AbstractContextManager]
                        = contextlib.nullcontext, ledger: CommLedger | None = None,
                        compute_context: Callable[[], contextlib.AbstractContextManager]
                        = contextlib.nullcontext) -> PathPipeline:
    """This rank's stage replica and the paths the path scheduler chooses for ``job``'s
    ``pp`` stages x ``dp_replicate`` replicas and ``dp_replicate x microbatches``
    microbatches (one prioritized-planning pass, no repair, on a uniform cluster: every
    rank identical, so the paths avoid collisions only). Every rank computes the same
    paths (a pure function of the layout). Collective: every rank calls it."""
    lay = job.layout
    stages, replicas = lay.pp, lay.dp_replicate
    coords = grid.coords(rank)
    stage, replica = coords["pp"], coords["dp_replicate"]
    ranks = [0] * (stages * replicas)
    for members in grid.groups("dp_replicate"):  # ordered by the pp coordinate
        for r, member in enumerate(members):
            ranks[grid.coords(member)["pp"] * replicas + r] = member
    microbatches = replicas * lay.microbatches
    rules = skip_count(stages, skip_ratio)
    cluster = Cluster(tuple(Node(f"rank{i}") for i in range(stages * replicas)),
                      Link(1e-4, 1.25e9))
    allocation = {(s, r): s * replicas + r for s in range(stages) for r in range(replicas)}
    costs = PathCosts.uniform(stages, 1.0, lay.micro_batch * job.seq_len * job.args.dim * 4)
    paths = PathScheduler(rules, replicas, cluster, allocation, costs).schedule(
        microbatches, rounds=0, restarts=0)
    layers = partition_model(job.args, stages, job.seq_len)
    module_stage = build_path_stage(job.args, stages, stage, layers, device, job.seed,
                                    autocast)
    module_stage.applied = Parallelized(module_stage.module)
    stage_group = path_groups(stages, replicas, ranks, rank)
    train = PathRuntime(paths, module_stage, replica, ranks, stage_group=stage_group,
                        ledger=ledger, compute_context=compute_context)
    evaluate = PathRuntime(full_paths(stages, microbatches, replicas), module_stage,
                           replica, ranks, stage_group=stage_group, ledger=ledger,
                           compute_context=compute_context)
    pp_group = meshes.root["pp"].get_group()
    return PathPipeline(train, evaluate, schedule_of(lay, max_stages=job.args.n_layers),
                        pp_group, grid.group(rank, "pp"), stage)


def path_groups(num_stages: int, num_replicas: int, ranks: Sequence[int], rank: int
                ) -> dist.ProcessGroup | None:
    """This rank's stage group (the replicas of its stage), created collectively: every rank
    calls this with the same arguments. None at one replica."""
    if num_replicas == 1:
        return None
    mine = None
    for stage in range(num_stages):
        members = [ranks[stage * num_replicas + r] for r in range(num_replicas)]
        group = dist.new_group(members)
        if rank in members:
            mine = group
    return mine


__all__ = ["PathPipeline", "PathRuntime", "build_path_pipeline", "build_path_stage",
           "gather_microbatches", "path_groups"]
