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
* Plan. Without a cluster the paths avoid collisions only (a uniform cluster). On an emulated
  cluster (``loom train --cluster FILE --emulate``) ``plan_paths`` runs the path scheduler on
  its node speeds and links, every stage replica on the node of its rank, priced by forward
  times measured at start-up (``measure_forward_s``); the replicas run in that cluster's replay
  order, and each point-to-point message carries its send time so the receiver can add the
  link's latency in software (``emulated_link_time``; the kernel here has no netem). A
  checkpoint keeps the paths and orders (``PathPipeline.state_dict``): a resume runs the same.

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
import math
import time
from collections.abc import Callable, Mapping, Sequence
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
# the runtime's messages (their ``peer`` is a global rank here: paths span the replicas)
from loom.pipeline.transfers import ACTIVATION, GRADIENT, WIRE_DTYPE, Transfer
from loom.pipeline.stage import LossFn, PipelineStage
from loom.schedule.path_replay import (BACKWARD, FORWARD, PathCosts, Task, execution_orders,
                                       replay_paths)
from loom.schedule.path_search import PathScheduler, schedule_paths
from loom.schedule.paths import PathRules, PathSet, check_paths, full_paths, skip_count
from loom.schedule.select import schedule_of
from loom.topology import Meshes, RankGrid

WIRE_BYTES = 4
_STAMP = 2  # a float64 send time travels as two fp32 words after the payload

# seconds a message of ``nbytes`` from global rank ``src`` to ``dst`` takes at least
LinkTime = Callable[[int, int, int], float]


def _stamp(device: torch.device) -> torch.Tensor:
    """The wall-clock time now, as ``_STAMP`` fp32 words (its float64's bits)."""
    return torch.tensor([time.time()], dtype=torch.float64).view(WIRE_DTYPE).to(device)


def emulated_link_time(cluster: Cluster) -> LinkTime:
    """Latency emulated in software (``loom.emulate`` shapes bandwidth only, the kernel has no
    netem): a message between ranks i and j is delivered no earlier than
    ``cluster.link(i, j).time(nbytes)`` after it was sent. Ranks of one machine share the
    clock, so the receiver compares the send time that travels with the message to its own."""
    def link_time(src: int, dst: int, nbytes: int) -> float:
        return 0.0 if src == dst else cluster.link(src, dst).time(nbytes)
    return link_time


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


class PathRuntime:
    """Runs ``paths`` on this rank's ``stage`` (a ``PipelineStage``), which is replica
    ``replica``. ``ranks[s * R + r]`` is the global rank of stage s replica r; ``group`` joins
    them all (None: the default group); ``stage_group`` joins this stage's replicas (None when
    R = 1). ``link_time``: emulated latency (``emulated_link_time``; None on a real network):
    when given, every message carries its send time (8 bytes more) and the receiver holds it
    until the link's time has passed since."""

    def __init__(self, paths: PathSet, stage: PipelineStage, replica: int, ranks: Sequence[int],
                 group: dist.ProcessGroup | None = None,
                 stage_group: dist.ProcessGroup | None = None, *,
                 orders: dict[tuple[int, int], list[Task]] | None = None,
                 ledger: CommLedger | None = None, recv_lookahead: int = 4,
                 compute_context: Callable[[], contextlib.AbstractContextManager]
                 = contextlib.nullcontext, link_time: LinkTime | None = None) -> None:
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
        # emulated link latency (``emulated_link_time``): None on a real network
        self.link_time = link_time
        self.me = self.rank_of(stage.model_stage, replica)

    def use_paths(self, paths: PathSet, orders: dict[tuple[int, int], list[Task]] | None = None
                  ) -> None:
        """Run ``paths`` from the next step on (a resumed run's saved paths), in ``orders``
        (default: a uniform replay's)."""
        if (paths.num_stages, paths.num_replicas) != (self.paths.num_stages,
                                                      self.paths.num_replicas):
            raise ValueError(f"paths over {paths.num_stages} x {paths.num_replicas} stage "
                             f"replicas for a runtime of {self.paths.num_stages} x "
                             f"{self.paths.num_replicas}")
        orders = orders if orders is not None else execution_orders(paths)
        expected: dict[tuple[int, int], list[Task]] = {
            (s, r): [] for s in range(paths.num_stages) for r in range(paths.num_replicas)}
        for m, path in enumerate(paths.paths):
            for k, visit in enumerate(path.visits):
                expected[visit.stage, visit.replica] += [Task(m, k, FORWARD), Task(m, k, BACKWARD)]
        for key, tasks in expected.items():
            if sorted(orders.get(key, []), key=repr) != sorted(tasks, key=repr):
                raise ValueError(f"the order of stage {key[0]} replica {key[1]} does not run "
                                 "exactly its visits of the paths")
        self.paths, self.orders = paths, orders

    def rank_of(self, stage: int, replica: int) -> int:
        return self.ranks[stage * self.paths.num_replicas + replica]

    def _incoming(self, task: Task) -> Transfer | None:
        path = self.paths.paths[task.microbatch].visits
        if task.op == FORWARD and task.index > 0:
            prev = path[task.index - 1]
            return Transfer(path[task.index].stage, task.microbatch, ACTIVATION,
                             self.rank_of(prev.stage, prev.replica))
        if task.op == BACKWARD and task.index + 1 < len(path):
            nxt = path[task.index + 1]
            return Transfer(path[task.index].stage, task.microbatch, GRADIENT,
                             self.rank_of(nxt.stage, nxt.replica))
        return None

    def _outgoing(self, task: Task) -> Transfer | None:
        path = self.paths.paths[task.microbatch].visits
        if task.op == FORWARD and task.index + 1 < len(path):
            nxt = path[task.index + 1]
            return Transfer(nxt.stage, task.microbatch, ACTIVATION,
                             self.rank_of(nxt.stage, nxt.replica))
        if task.op == BACKWARD and task.index > 0:
            prev = path[task.index - 1]
            return Transfer(prev.stage, task.microbatch, GRADIENT,
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
        posted: dict[Transfer, tuple[dist.Work, torch.Tensor]] = {}
        numel = math.prod(activation_shape)
        stamp = _STAMP if self.link_time is not None else 0  # the send time rides along
        sends: list[dist.Work] = []
        next_to_post = 0
        loss_sum = torch.zeros((), device=device)
        for index, task in enumerate(row):
            while next_to_post < min(len(row), index + 1 + self.recv_lookahead):
                needed = self._incoming(row[next_to_post])
                if needed is not None:
                    buffer = torch.empty(numel + stamp, dtype=WIRE_DTYPE, device=device)
                    work = comm.irecv(buffer, needed.peer, self.group, axis="pp",
                                      ledger=self.ledger, tag=needed.tag(num_microbatches))
                    posted[needed] = (work, buffer)
                next_to_post += 1
            needed = self._incoming(task)
            received = None
            if needed is not None:
                work, buffer = posted.pop(needed)
                work.wait()
                if stamp:
                    self._hold(buffer[numel:], needed.peer, numel * WIRE_BYTES)
                received = buffer[:numel].view(tuple(activation_shape))
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
                payload = result.detach().to(WIRE_DTYPE).reshape(-1)
                if stamp:
                    payload = torch.cat([payload, _stamp(device)])
                payload = payload.contiguous()
                sends.append(comm.isend(payload, message.peer, self.group, axis="pp",
                                        ledger=self.ledger, tag=message.tag(num_microbatches)))
        for work in sends:
            work.wait()
        comm.all_reduce(loss_sum, self.group, axis="pp", ledger=self.ledger)
        return loss_sum

    def _hold(self, stamp: torch.Tensor, peer: int, nbytes: int) -> None:
        """Emulated latency: deliver a message from ``peer`` no earlier than ``link_time`` after
        its send time (``stamp``). The shaped link already took its bytes' time; this adds what
        is left of the latency (a message queued behind another on the link is delivered up to
        one message's wire time early)."""
        sent = stamp.view(torch.float64).item()
        wait = sent + self.link_time(peer, self.me, nbytes) - time.time()
        if wait > 0:
            time.sleep(wait)

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
        if self.link_time is not None:  # a ring's 2(R-1) steps each wait one latency
            replicas = [self.rank_of(self.stage.model_stage, r)
                        for r in range(self.paths.num_replicas)]
            time.sleep(2 * (len(replicas) - 1) * max(
                self.link_time(a, b, 0) for a in replicas for b in replicas if a != b))
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
    vocab = None  # no vocabulary shard (the config refuses vocab_parallel_pp with paths)

    def __init__(self, train: PathRuntime, evaluate: PathRuntime, schedule,
                 pp_group: dist.ProcessGroup | None, pp_ranks: Sequence[int],
                 pp_rank: int, plan: PathPlan | None = None) -> None:
        self.train, self.evaluate, self.schedule = train, evaluate, schedule
        self.pp_group, self.pp_ranks, self.pp_rank = pp_group, tuple(pp_ranks), pp_rank
        self.stages = {train.stage.model_stage: train.stage}
        self.replicas = train.paths.num_replicas
        self.plan = plan  # what the training paths were planned on (``plan_paths``)

    @property
    def paths(self) -> PathSet:
        """The training paths this pipeline runs."""
        return self.train.paths

    def describe(self) -> str:
        """For the log: the training paths and, planned on a cluster, the costs they were
        priced with and the iteration time the replay predicts for them."""
        plan, paths = self.plan, self.train.paths
        if plan is None or not plan.measured:
            return f"skippipe: paths planned for collisions only (no cluster)\n{paths}"
        predicted = replay_paths(paths, plan.cluster, plan.allocation, plan.costs).makespan
        forward = ", ".join(f"{t * 1e3:.1f}" for t in plan.costs.forward_s)
        return (f"skippipe: paths planned on the emulated cluster; measured forward ms per "
                f"stage and microbatch {forward}; predicted iteration {predicted:.3f} s\n"
                f"{paths}")

    def state_dict(self) -> dict:
        """The training paths and every replica's order of work (plain JSON, for a
        checkpoint's extra.json): on an emulated cluster both depend on forward times measured
        at start-up, so a resumed run keeps what it trained with rather than planning again
        (the order of a replica's microbatches is the order its gradients accumulate in)."""
        orders = {f"{s}.{r}": [[t.microbatch, t.index, t.op] for t in tasks]
                  for (s, r), tasks in sorted(self.train.orders.items())}
        return {"paths": self.train.paths.to_dict(), "orders": orders}

    def load_state_dict(self, state: dict) -> bool:
        """Train on the saved paths, in the saved orders, from the next step on; False (nothing
        changed) when they are for another shape (stages, replicas or microbatches: a
        checkpoint of another layout, which reshards by name) or break this run's path rules
        (another skip ratio): this run's own paths are kept then."""
        saved = PathSet.from_dict(state["paths"])
        mine = self.train.paths
        if (saved.num_stages, saved.num_replicas, saved.num_microbatches) != \
                (mine.num_stages, mine.num_replicas, mine.num_microbatches):
            return False
        if self.plan is not None:
            try:
                check_paths(saved, self.plan.rules)
            except ValueError:
                return False
        orders = {tuple(int(i) for i in key.split(".")): [Task(int(m), int(k), str(op))
                                                          for m, k, op in tasks]
                  for key, tasks in state["orders"].items()}
        self.train.use_paths(saved, orders)
        return True

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


@dataclass(frozen=True)
class PathPlan:
    """What the trainer's paths were planned on: the rules, the cluster (node i is rank i),
    ``allocation[(stage, replica)]`` (the global rank, so the node, of each stage replica),
    the costs, and the paths chosen for ``num_microbatches`` microbatches. ``measured``: the
    costs' forward times were measured on the ranks (an emulated cluster), not uniform."""

    rules: PathRules
    num_replicas: int
    num_microbatches: int
    cluster: Cluster
    allocation: Mapping[tuple[int, int], int]
    costs: PathCosts
    paths: PathSet
    measured: bool

    def orders(self) -> dict[tuple[int, int], list[Task]]:
        """Each replica's order of work: a replay of the paths on this cluster."""
        return execution_orders(self.paths, replay_paths(self.paths, self.cluster,
                                                          self.allocation, self.costs))


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_forward_s(stage: PipelineStage, micro_batch: int, seq_len: int,
                      num_stages: int, group: dist.ProcessGroup | None = None,
                      repeats: int = 3) -> tuple[float, ...]:
    """Every stage's forward time of one microbatch at full speed, measured: this rank times
    its own stage's module (no gradient, the fastest of ``repeats`` after a warm-up; the
    emulated node slowdown is not entered) and one MAX all-reduce over ``group`` (None: the
    default) gives every rank the slowest replica's time of every stage, the same numbers on
    every rank. Collective."""
    module, device = stage.module, stage.module.rope_cos.device
    if stage.is_first:
        x = torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device)
    else:
        x = torch.zeros((micro_batch, seq_len, module.args.dim), device=device)
    best = math.inf
    with torch.no_grad(), stage.autocast():
        for i in range(repeats + 1):
            _synchronize(device)
            start = time.perf_counter()
            module(x)
            _synchronize(device)
            if i:
                best = min(best, time.perf_counter() - start)
    times = torch.zeros(num_stages, dtype=torch.float64, device=device)
    times[stage.model_stage] = best
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return tuple(times.tolist())


def plan_paths(rules: PathRules, num_replicas: int, num_microbatches: int,
               activation_bytes: float, gradient_bytes: Sequence[float],
               ranks: Sequence[int], cluster: Cluster | None,
               forward_s: Sequence[float] | None = None) -> PathPlan:
    """The trainer's paths. Without a cluster: one prioritized-planning pass (no repair) on a
    uniform cluster of identical ranks and links, unit forward times: paths that avoid
    collisions only, a pure function of the layout. With one (``loom train --cluster FILE
    --emulate``): the path scheduler in full (``loom.schedule.path_search.schedule_paths``'s
    defaults) on that cluster's node speeds and links, each stage replica on the node of its
    rank (``ranks[s * R + r]``), priced by ``forward_s`` (at compute factor 1.0), backward 2x,
    ``activation_bytes`` per hop and each stage's ``gradient_bytes`` for the replicas'
    averaging."""
    stages = rules.num_stages
    allocation = {(s, r): ranks[s * num_replicas + r] for s in range(stages)
                  for r in range(num_replicas)}
    if cluster is None:
        cluster = Cluster(tuple(Node(f"rank{i}") for i in range(stages * num_replicas)),
                          Link(1e-4, 1.25e9))
        allocation = {(s, r): s * num_replicas + r for s in range(stages)
                      for r in range(num_replicas)}
        costs = PathCosts.uniform(stages, 1.0, activation_bytes)
        paths = PathScheduler(rules, num_replicas, cluster, allocation, costs).schedule(
            num_microbatches, rounds=0, restarts=0)
        return PathPlan(rules, num_replicas, num_microbatches, cluster, allocation, costs,
                        paths, measured=False)
    if forward_s is None or len(forward_s) != stages:
        raise ValueError(f"planning on a cluster needs the forward time of each of the "
                         f"{stages} stages, got {forward_s!r}")
    if max(ranks) >= cluster.size:
        raise ValueError(f"rank {max(ranks)} has no node in a cluster of {cluster.size}")
    costs = PathCosts(tuple(float(t) for t in forward_s), float(activation_bytes),
                      gradient_bytes=tuple(float(b) for b in gradient_bytes))
    paths = schedule_paths(rules, num_replicas, num_microbatches, cluster, allocation, costs)
    return PathPlan(rules, num_replicas, num_microbatches, cluster, allocation, costs, paths,
                    measured=True)


def build_path_pipeline(job: Job, skip_ratio: float, *, grid: RankGrid, meshes: Meshes,
                        rank: int, device: torch.device,
                        autocast: Callable[[], contextlib.AbstractContextManager]
                        = contextlib.nullcontext, ledger: CommLedger | None = None,
                        compute_context: Callable[[], contextlib.AbstractContextManager]
                        = contextlib.nullcontext, cluster: Cluster | None = None
                        ) -> PathPipeline:
    """This rank's stage replica and the paths for ``job``'s ``pp`` stages x
    ``dp_replicate`` replicas and ``dp_replicate x microbatches`` microbatches
    (``plan_paths``). ``cluster``: the emulated cluster the ranks run on (node i is rank i,
    ``loom.train.distributed.DistContext.cluster``): the path scheduler plans on its speeds
    and links, priced by each stage's measured forward (``measure_forward_s``), rank 0
    plans and broadcasts the paths, every replica runs in that cluster's replay order, and
    the point-to-point messages get the links' latency in software
    (``emulated_link_time``). Collective: every rank calls it."""
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
    layers = partition_model(job.args, stages, job.seq_len)
    module_stage = build_path_stage(job.args, stages, stage, layers, device, job.seed,
                                    autocast)
    module_stage.applied = Parallelized(module_stage.module)
    activation_bytes = lay.micro_batch * job.seq_len * job.args.dim * WIRE_BYTES
    forward_s, gradient_bytes = None, [0.0] * stages
    if cluster is not None:
        cluster.check_world(grid.size, "cluster")
        forward_s = measure_forward_s(module_stage, lay.micro_batch, job.seq_len, stages)
        sizes = torch.zeros(stages, dtype=torch.float64, device=device)
        sizes[stage] = 4.0 * sum(p.numel() for p in module_stage.parameters())
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        gradient_bytes = sizes.tolist()
    plan = None
    if cluster is None or rank == 0:
        plan = plan_paths(rules, replicas, microbatches, activation_bytes, gradient_bytes,
                          ranks, cluster, forward_s)
    if cluster is not None:  # one rank plans (seconds of pure Python), every rank runs it
        shared = [plan.paths.to_json() if plan is not None else None]
        dist.broadcast_object_list(shared, src=0)
        paths = PathSet.from_json(shared[0])
        allocation = {(s, r): ranks[s * replicas + r] for s in range(stages)
                      for r in range(replicas)}
        plan = PathPlan(rules, replicas, microbatches, cluster, allocation,
                        PathCosts(tuple(forward_s), float(activation_bytes),
                                  gradient_bytes=tuple(gradient_bytes)),
                        paths, measured=True)
    link_time = emulated_link_time(cluster) if cluster is not None else None
    stage_group = path_groups(stages, replicas, ranks, rank)
    train = PathRuntime(plan.paths, module_stage, replica, ranks, stage_group=stage_group,
                        ledger=ledger, compute_context=compute_context,
                        orders=plan.orders() if cluster is not None else None,
                        link_time=link_time)
    evaluate = PathRuntime(full_paths(stages, microbatches, replicas), module_stage,
                           replica, ranks, stage_group=stage_group, ledger=ledger,
                           compute_context=compute_context, link_time=link_time)
    pp_group = meshes.root["pp"].get_group()
    return PathPipeline(train, evaluate, schedule_of(lay, max_stages=job.args.n_layers),
                        pp_group, grid.group(rank, "pp"), stage, plan)


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


__all__ = ["PathPipeline", "PathPlan", "PathRuntime", "build_path_pipeline", "build_path_stage",
           "emulated_link_time", "gather_microbatches", "measure_forward_s", "path_groups",
           "plan_paths"]
