"""Outer-loop data parallelism across replicas: DiLoCo (and its streaming variant), NoLoCo, CO2.

What it does. Each replica (one ``dp_replicate`` coordinate, with whatever tp / pp / cp / ep /
ZeRO layout it has inside) trains on its own data with its own inner optimizer (AdamW) and no
gradient all-reduce across replicas. ``OuterLoop.after_inner_step`` is called after every inner
optimizer step; every H steps (``outer_steps``) it takes an *outer step*: each replica's
pseudo-gradient ``delta_i = phi - theta_i`` (the snapshot ``phi`` taken at the last outer step
minus the current weights) is combined with the other replicas', fed to an outer SGD with
Nesterov (diloco) or heavy-ball (noloco, co2) momentum, and every replica restarts from the new
snapshot. Written with torch's SGD convention (``nesterov=True``, no dampening), with g the
combined outer gradient::

    m   <- mu * m + g
    phi <- phi - lr * (g + mu * m)          (nesterov=False: phi <- phi - lr * m, heavy ball)
    theta_i <- phi

The modes differ in g and in when it is applied:

* ``diloco`` (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): g = mean_i delta_i over
  all replicas, one all-reduce. With lr = 1 and mu = 0 this is phi <- mean_i theta_i: parameter
  averaging after every H local steps, which equals synchronous data parallelism only when the
  inner optimizer is plain SGD (averaging weights after an AdamW step is not averaging gradients
  before it).
* streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), ``fragments=F`` with ``diloco``:
  the parameters are split into F contiguous fragments of about equal size, and fragment f takes
  its outer step at the inner steps s with ``s % H == ((f + 1) * H // F) % H``, so the F
  synchronisations are spread evenly over the window and each moves 1/F of the model (the peak
  bandwidth drops F-fold, the bytes per step do not). The paper's overlapped form (a fragment's
  update applied tau steps late and mixed with the local weights) is not implemented; ``co2`` is
  Loom's overlapped mode.
* ``noloco`` (Kolehmainen et al. 2025, arXiv 2506.10911): no collective at all. At every outer
  step the replicas are paired by a seeded permutation (``noloco_pairs``: a pure function of
  ``seed`` and the outer step's index, identical on every rank) and each replica i exchanges one
  tensor with its peer p. Its outer gradient is the pair's mean pseudo-gradient plus NoLoCo's
  consensus term, which pulls the replicas' own snapshots (they are no longer identical) together::

      g_i = (delta_i + delta_p) / 2 + c * (phi_i - (phi_i + phi_p) / 2)

  c is ``noloco_consensus``, the consensus term's weight against the pseudo-gradient's (the
  authors' code weighs them equally: c = 1). With c = 1, lr = 1 and mu = 0 a pair ends at
  (theta_i + theta_p) / 2: one gossip averaging step. The outer step is heavy ball, like CO2's
  (``nesterov`` defaults to False for noloco): the paper's abstract calls it a "variant of the
  Nesterov momentum optimizer", and the authors' code (jkolehm/noloco, ``sparse_optimizer_c.py``,
  ``outer_step``) computes it as ``v <- mu v + lr g_i; phi_i <- phi_i - v``, which for a
  constant lr is ``m <- mu m + g_i; phi_i <- phi_i - lr m`` (the paper's full text was not
  checked). Until 2026-11-26 Loom's noloco took torch's Nesterov
  ``phi_i - lr (g_i + mu m)`` like DiLoCo, which weighs each new g_i by (1 + mu) instead of 1;
  with mu = 0 the two are the same.
  Since g_i = ((1 + c) phi_i - theta_i + s_p) / 2 with s_p = (1 - c) phi_p - theta_p, the peer
  sends s_p alone: one tensor of the model's size each way. With an odd number of replicas the
  last one in the permutation sits the exchange out: it takes the same outer step on its own
  pseudo-gradient (a group of one: g = delta_i, no consensus term), and the seeded permutation
  picks a different replica to sit out next time.
* ``co2`` (Sun et al. 2024, arXiv 2401.16265, ICLR 2024, Algorithm 1): the all-reduce of the
  pseudo-gradients is launched asynchronously at outer step t and only waited for at outer step
  t + 1, so it overlaps the H inner steps in between; the outer update at step t therefore uses
  the one-step-stale average of the pseudo-gradients, computed at ``x_{t-1,0}``, applied at
  ``x_{t,0}``::

      g_t       = mean_i(x_{t-1,0} - x^i_{t-1,tau}) / Lambda_t     (staleness-gap penalty)
      m_t       = clip(mu * m_{t-1} + g_t, phi_clip)               (outer momentum clipping)
      x_{t+1,0} = x_{t,0} - lr * m_t                               (heavy ball)

  The outer step is heavy ball: ``nesterov`` defaults to False for co2 (and noloco; True for
  diloco, DiLoCo's Nesterov). Until 2026-11-26 co2 took Nesterov's ``g_t + mu * m_t`` like the
  other modes; on a one-step-stale average that look-ahead moves x further from where the
  average was computed, and the penalty below then divides the next step by a larger Lambda.
  Staleness-gap penalty: Lambda_t >= 1 grows with the gap ``x_{t,0} - x_{t-1,0}`` between the
  weights the stale average was computed from and the weights it is applied to. Loom computes it
  per tensor as ``1 + lambda * |x_{t,0} - x_{t-1,0}| / |stale average|``, Gap-Aware's
  normalisation (Barkai et al., ICLR 2020: the gap measured in units of one update;
  ``co2_gap_penalty`` = lambda, 0 turns it off). Clipping is elementwise to
  [-phi_clip, phi_clip] (``co2_clip``, None: off), applied to the momentum after the penalised
  average enters it and before the step. The first outer step has no stale average yet: it
  applies nothing and the replicas restart from the starting weights (their H steps arrive one
  outer step late, which is CO2's delay).
  What this was checked against (2026-11-26, issue 19): the paper's abstract and its six
  OpenReview reviews (one notes that its Eq. 3, the penalty's analysis, assumes a decaying inner
  learning rate), and the authors' code that the paper links (weigao266/fairscale-CO2,
  ``gossip/co2.py``, ``_perform_local_optimization``): ``m <- mu m + (x_old - x) / lambda;
  clip(m); x_old <- x_old - lr m`` — heavy ball, the order above, lambda a constant, the clip
  elementwise (there ``torch.clamp``'s result is discarded, so their clip does nothing as
  written; Loom clamps in place, its evident intent). The text of the paper's Section 3, with
  Lambda_t's own normalisation, was not available to check: Loom's Gap-Aware ratio is Loom's
  choice, and with ``co2_gap_penalty = 0`` the update is the authors' code with lambda = 1
  (their default). The norms are over the rank's local shard, so with lambda > 0 the result
  depends on the tp / ZeRO layout inside a replica (a layout-independent norm would cost one
  all-reduce of a float per tensor).

Communication (group: ``group``, the ranks holding the same shard in different replicas — a
``dp_replicate`` group of the rank grid; every tensor is the rank's local shard, fp32; P_local
elements of trainable parameters on this rank; counted in ``ledger`` under ``axis``):

==========  ==========================================  =================================
mode        what, when                                   wire bytes per rank (comm.py's)
==========  ==========================================  =================================
diloco      all-reduce of the pseudo-gradients, every H  2 (R-1)/R * 4 P_local per H steps
streaming   the same per fragment, F times per H         2 (R-1)/R * 4 P_local per H steps
noloco      isend + irecv with one peer, every H         4 P_local per H steps (send)
co2         async all-reduce, every H, waited H later    2 (R-1)/R * 4 P_local per H steps
==========  ==========================================  =================================

Pseudo-gradients are packed into fp32 buckets of ``bucket_bytes`` in parameter order, at most
``MAX_IN_FLIGHT`` + 1 at a time (diloco). ``loom.formulas.outer`` prices the same volumes for the
planner. Memory: an fp32 snapshot and momentum of every local parameter (8 bytes each), plus for
co2 the last displacement and the pending average (16 in all).

Composition. The object takes the parameters as they are after ``parallelize``: plain tensors
or DTensors (tp, FSDP2), whose ``_local_tensor`` it reads and writes in place — the replica group
only ever combines identically sharded local tensors (under expert parallelism an ep rank's
experts: the group pairs one ep coordinate across replicas, so the same experts). Call
``after_inner_step`` after the inner optimizer step (under FSDP2 the parameters are then
sharded, which is what it must see), on every rank of every replica. Replicas must start
from identical weights. Under Loom's ZeRO-1/2 every dp_shard rank holds its replica's whole
model: given all of it, each dp_shard rank would send the whole model across replicas
(dp_shard times the bytes), so the trainer gives each rank only the slices its optimizer owns
(``Trainer._outer_loop``: one tensor per bucket) and re-gathers them inside the replica after
an outer step (one all-gather of the model per H steps). With bf16 parameters
(``train.dtype = bf16``) the weights the inner AdamW steps are the fp32 masters: the outer loop
reads and merges those (``param.master_weight`` without ZeRO; the ZeRO-1/2 slices and FSDP2's
sharded parameters already are the fp32 masters) and restarts every bf16 parameter at its
master's rounding, so the snapshot, momentum and pseudo-gradients are the fp32 run's.

Checkpoints. ``state_dict`` holds the counters, the snapshot and momentum (and co2's displacement
and pending average, after waiting for it), by parameter name; a DTensor parameter's state is a
DTensor of the same mesh and placements, so DCP can reshard it within a replica. For diloco and
co2 these are identical on every replica; for noloco every replica's snapshot and momentum are
its own, and in every mode the inner optimizer's state and, between outer steps, the weights
differ across replicas — a checkpoint must keep one copy per replica (DCP keeps one copy of a
tensor that is replicated over ``dp_replicate``). ``load_state_dict`` copies in place, so resuming
is bit-exact.

Why hand-written: torchft's DiLoCo (the closest PyTorch anchor) runs inside torchft's Manager
(quorums, a Lighthouse server, fault tolerance) that Loom does not use, issues its collectives
through the Manager where ``comm.py`` cannot count them, and has neither NoLoCo nor CO2; torchft
is not a dependency. The reference codes of NoLoCo and CO2 are research forks (blocking sends
through a root rank; a fairscale fork).
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.formulas.memory import BUCKET_BYTES, MAX_IN_FLIGHT
from loom.parallel import comm
from loom.parallel.comm import local_shard
from loom.parallel.mixed_precision import MASTER, has_master

MODES: tuple[str, ...] = ("diloco", "noloco", "co2")
_NORM_FLOOR = 1e-12  # keeps the staleness ratio finite when a stale average is exactly zero


def noloco_pairs(replicas: int, seed: int,
                 outer_step: int) -> tuple[tuple[tuple[int, int], ...], int | None]:
    """NoLoCo's pairing of ``replicas`` replicas at outer step ``outer_step`` (0-based): the
    pairs of a seeded random permutation taken two by two, and the replica left alone (None when
    ``replicas`` is even). A pure function of its arguments, so every rank computes the same
    schedule and a rerun reproduces it; hashlib, not ``random``, so it does not depend on the
    Python version's generator."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    order = list(range(replicas))
    for top in range(replicas - 1, 0, -1):  # Fisher-Yates
        other = _uniform_below(top + 1, seed, outer_step, top)
        order[top], order[other] = order[other], order[top]
    pairs = tuple((order[k], order[k + 1]) for k in range(0, replicas - 1, 2))
    return pairs, (order[-1] if replicas % 2 else None)


def _uniform_below(n: int, seed: int, outer_step: int, draw: int) -> int:
    digest = hashlib.sha256(f"loom.noloco/{seed}/{outer_step}/{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % n  # bias n / 2**64: negligible


def fragment_offsets(outer_steps: int, fragments: int) -> tuple[int, ...]:
    """Streaming DiLoCo's schedule: fragment f synchronises at the inner steps s (1-based) with
    ``s % outer_steps == offset[f]``; the offsets are distinct and evenly spread when
    ``fragments <= outer_steps``, and the last fragment syncs at the multiples of H."""
    return tuple(((f + 1) * outer_steps // fragments) % outer_steps for f in range(fragments))


def _fragment_of_each(numels: list[int], fragments: int) -> list[int]:
    """Contiguous fragments of about equal element count: a parameter goes to the fragment its
    midpoint falls in."""
    total = sum(numels)
    out, before = [], 0
    for numel in numels:
        out.append(min(fragments - 1, (2 * before + numel) * fragments // max(1, 2 * total)))
        before += numel
    return out


@dataclass
class _Bucket:
    indices: list[int]  # positions in OuterLoop.params, consecutive
    numel: int
    fragment: int


def _check_arguments(mode: str, outer_steps: int, outer_lr: float, outer_momentum: float,
                     fragments: int, noloco_consensus: float, co2_gap_penalty: float,
                     co2_clip: float | None) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(outer_steps, int) or outer_steps < 1:
        raise ValueError(f"outer_steps (inner steps per outer step, H) must be an integer >= 1, "
                         f"got {outer_steps!r}")
    if not outer_lr > 0:
        raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
    if fragments > 1 and mode != "diloco":
        raise ValueError(f"fragments (streaming) applies to mode diloco only, got mode {mode!r} "
                         f"with fragments={fragments}")
    if fragments > outer_steps:
        raise ValueError(f"fragments must be <= outer_steps so that each fragment has its own "
                         f"inner step; got fragments={fragments}, outer_steps={outer_steps}")
    if not noloco_consensus >= 0:
        raise ValueError(f"noloco_consensus must be >= 0, got {noloco_consensus!r}")
    if not co2_gap_penalty >= 0:
        raise ValueError(f"co2_gap_penalty must be >= 0, got {co2_gap_penalty!r}")
    if co2_clip is not None and not co2_clip > 0:
        raise ValueError(f"co2_clip must be > 0 or None, got {co2_clip!r}")


class OuterLoop:
    """The outer optimizer of one rank: its share of the replicas' snapshot and momentum, and the
    schedule of outer steps (see the module docstring).

    ``named_parameters``: ``model.named_parameters()`` (or a mapping) after ``parallelize``;
    parameters that do not require gradients are left alone. ``group``: the replica process group
    (this rank and the ranks holding the same shard in the other replicas), of size R >= 2.
    ``seed``: NoLoCo's pairing schedule. ``ledger``/``axis``: where the bytes are counted.
    ``nesterov``: the outer step's momentum form; None picks the paper's (diloco: Nesterov,
    noloco and co2: heavy ball, as their authors' code steps).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]]
                 | Mapping[str, nn.Parameter], group: Any, *, mode: str, outer_steps: int,
                 outer_lr: float, outer_momentum: float = 0.9, nesterov: bool | None = None,
                 seed: int = 0, fragments: int = 1, noloco_consensus: float = 1.0,
                 co2_gap_penalty: float = 1.0, co2_clip: float | None = None,
                 ledger: comm.CommLedger | None = None, axis: str = "dp_replicate",
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        _check_arguments(mode, outer_steps, outer_lr, outer_momentum, fragments,
                         noloco_consensus, co2_gap_penalty, co2_clip)
        pairs = named_parameters.items() if isinstance(named_parameters, Mapping) \
            else named_parameters
        trainable, seen = [], set()
        for name, p in pairs:
            if p.requires_grad and id(p) not in seen:  # a Parameter tied across stages: once
                trainable.append((name, p))
                seen.add(id(p))
        if not trainable:
            raise ValueError("named_parameters holds no parameter that requires a gradient")
        replicas = dist.get_world_size(group)
        if replicas < 2:
            raise ValueError(f"group must hold at least 2 replicas for an outer loop, got a "
                             f"group of {replicas} (dp_replicate = 1 has nothing to average)")
        self.mode, self.outer_steps, self.fragments = mode, outer_steps, fragments
        if nesterov is None:  # DiLoCo's Nesterov; NoLoCo's and CO2's heavy ball (their code)
            nesterov = mode == "diloco"
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.seed, self.noloco_consensus = seed, noloco_consensus
        self.co2_gap_penalty, self.co2_clip = co2_gap_penalty, co2_clip
        self.group, self.replicas, self.replica = group, replicas, dist.get_rank(group)
        self.ledger, self.axis = ledger, axis
        self.names = [name for name, _ in trainable]
        self.params = [p for _, p in trainable]
        self.inner_steps = 0  # inner steps seen (after_inner_step calls)
        self.outer_step_count = [0] * fragments  # outer steps taken, per fragment
        self._offsets = fragment_offsets(outer_steps, fragments)
        self._buckets = self._make_buckets(bucket_bytes)
        with torch.no_grad():
            self._snapshot = [self._value(i).detach().to(torch.float32, copy=True)
                              for i in range(len(self.params))]
            self._momentum = [torch.zeros_like(s) for s in self._snapshot]
            if mode == "co2":
                self._displacement = [torch.zeros_like(s) for s in self._snapshot]
                self._pending_flat = [torch.zeros(b.numel, dtype=torch.float32,
                                                  device=self._snapshot[b.indices[0]].device)
                                      for b in self._buckets]
                self._pending_work: list[Any] = [None] * len(self._buckets)
                self._pending_view = [torch.empty(0)] * len(self.params)
                for b, flat in zip(self._buckets, self._pending_flat):
                    for i, view in self._unflatten(flat, b):
                        self._pending_view[i] = view
                self.has_pending = False  # a stale average is waiting to be applied

    # -- the schedule ------------------------------------------------------------------------------
    def after_inner_step(self, step: int | None = None) -> bool:
        """Call after every inner optimizer step, on every rank. ``step`` (optional, 1-based) is
        the trainer's count of inner steps, checked against this object's own so a resume that
        forgot ``load_state_dict`` is caught. Returns whether an outer step was taken."""
        if step is not None and step != self.inner_steps + 1:
            raise ValueError(f"step {step} does not follow this outer loop's inner step "
                             f"{self.inner_steps} (was its state loaded on resume?)")
        self.inner_steps += 1
        took = False
        for fragment, offset in enumerate(self._offsets):
            if self.inner_steps % self.outer_steps == offset:
                self._outer_step(fragment)
                took = True
        return took

    def finish(self) -> None:
        """Wait for co2's in-flight all-reduce (keeping its average pending: nothing changes in
        the math); call before the process group goes away. Other modes have nothing in flight."""
        if self.mode == "co2":
            for k in range(len(self._buckets)):
                self._land_pending(k)

    def _outer_step(self, fragment: int) -> None:
        buckets = [b for b in self._buckets if b.fragment == fragment]
        with torch.no_grad():
            if self.mode == "diloco":
                self._diloco(buckets)
            elif self.mode == "noloco":
                self._noloco(buckets)
            else:
                self._co2(buckets)
        self.outer_step_count[fragment] += 1

    # -- the three modes ---------------------------------------------------------------------------
    def _diloco(self, buckets: list[_Bucket]) -> None:
        in_flight: deque = deque()
        for bucket in buckets:
            flat = self._pseudo_gradient(bucket)
            work = comm.all_reduce(flat, self.group, axis=self.axis, ledger=self.ledger,
                                   async_op=True)
            in_flight.append((work, flat, bucket))
            if len(in_flight) > MAX_IN_FLIGHT:
                self._land_average(*in_flight.popleft())
        while in_flight:
            self._land_average(*in_flight.popleft())

    def _land_average(self, work: Any, flat: torch.Tensor, bucket: _Bucket) -> None:
        work.wait()
        flat.div_(self.replicas)  # gloo has no AVG: sum, then divide
        for i, mean_delta in self._unflatten(flat, bucket):
            self._apply(i, mean_delta)

    def _noloco(self, buckets: list[_Bucket]) -> None:
        pairs, _ = noloco_pairs(self.replicas, self.seed, self.outer_step_count[0])
        peer = next((b if a == self.replica else a for a, b in pairs if self.replica in (a, b)),
                    None)
        c = self.noloco_consensus
        for tag, bucket in enumerate(buckets):
            phi = torch.cat([self._snapshot[i].reshape(-1) for i in bucket.indices])
            theta = torch.cat([self._value(i).reshape(-1).float() for i in bucket.indices])
            if peer is None:  # sitting this one out: a group of one
                outer_grad = phi.sub_(theta)
            else:
                mine = phi.mul(1 - c).sub_(theta)
                theirs = torch.empty_like(mine)
                peer_rank = dist.get_global_rank(self.group, peer)
                sent = comm.isend(mine, peer_rank, self.group, axis=self.axis, ledger=self.ledger,
                                  tag=tag)
                received = comm.irecv(theirs, peer_rank, self.group, axis=self.axis,
                                      ledger=self.ledger, tag=tag)
                sent.wait()
                received.wait()
                outer_grad = phi.mul_(1 + c).sub_(theta).add_(theirs).mul_(0.5)
            for i, g in self._unflatten(outer_grad, bucket):
                self._apply(i, g)

    def _co2(self, buckets: list[_Bucket]) -> None:
        for k, bucket in enumerate(buckets):
            fresh = self._pseudo_gradient(bucket)  # against x_{t,0}, before this step moves it
            if self.has_pending:
                self._land_pending(k)
                for i, stale in self._unflatten(self._pending_flat[k], bucket):
                    self._apply(i, stale / self._staleness_penalty(i, stale))
            else:  # x_{1,0} = x_{0,0}: nothing stale to apply yet
                for i in bucket.indices:
                    self._displacement[i].zero_()
                    self._write(i, self._snapshot[i])
            self._pending_flat[k].copy_(fresh)
            self._pending_work[k] = comm.all_reduce(self._pending_flat[k], self.group,
                                                    axis=self.axis, ledger=self.ledger,
                                                    async_op=True)
        self.has_pending = True

    def _land_pending(self, k: int) -> None:
        if self._pending_work[k] is not None:
            self._pending_work[k].wait()
            self._pending_work[k] = None
            self._pending_flat[k].div_(self.replicas)

    def _staleness_penalty(self, i: int, stale: torch.Tensor) -> torch.Tensor | float:
        """Lambda_t of this tensor: 1 + lambda |x_{t,0} - x_{t-1,0}| / |stale average| (a 0-d
        tensor, so no device sync)."""
        if self.co2_gap_penalty == 0:
            return 1.0
        gap = self._displacement[i].norm()
        return 1 + self.co2_gap_penalty * gap / stale.norm().clamp_min(_NORM_FLOOR)

    # -- the outer optimizer -----------------------------------------------------------------------
    def _apply(self, i: int, outer_grad: torch.Tensor) -> None:
        """One Nesterov (or heavy-ball) step of parameter i's snapshot; weights restart there."""
        mu, snapshot, momentum = self.outer_momentum, self._snapshot[i], self._momentum[i]
        momentum.mul_(mu).add_(outer_grad)
        if self.co2_clip is not None and self.mode == "co2":
            momentum.clamp_(-self.co2_clip, self.co2_clip)
        update = outer_grad.add(momentum, alpha=mu) if self.nesterov else momentum
        if self.mode == "co2":
            displacement = self._displacement[i]
            displacement.copy_(snapshot)
            snapshot.sub_(update, alpha=self.outer_lr)
            displacement.sub_(snapshot).neg_()  # x_{t+1,0} - x_{t,0}, the next step's gap
        else:
            snapshot.sub_(update, alpha=self.outer_lr)
        self._write(i, snapshot)

    # -- the weights it reads and writes -----------------------------------------------------------
    def _value(self, i: int) -> torch.Tensor:
        """Parameter i's local value as the inner optimizer steps it: the fp32 master of a bf16
        parameter (``loom.parallel.mixed_precision``), else the parameter itself."""
        param = self.params[i]
        return local_shard(getattr(param, MASTER) if has_master(param) else param)

    def _write(self, i: int, value: torch.Tensor) -> None:
        """Restart parameter i from ``value``: its master and its bf16 rounding (the rounding
        ``master_window`` gives it after an optimizer step), or the parameter itself."""
        param = self.params[i]
        if has_master(param):
            local_shard(getattr(param, MASTER)).copy_(value)
        local_shard(param).copy_(value)

    # -- packing -----------------------------------------------------------------------------------
    def _make_buckets(self, bucket_bytes: int) -> list[_Bucket]:
        numels = [local_shard(p).numel() for p in self.params]
        fragment_of = _fragment_of_each(numels, self.fragments)
        buckets: list[_Bucket] = []
        for i, (numel, fragment) in enumerate(zip(numels, fragment_of)):
            last = buckets[-1] if buckets else None
            if last is None or last.fragment != fragment or 4 * last.numel >= bucket_bytes:
                buckets.append(_Bucket([], 0, fragment))
            buckets[-1].indices.append(i)
            buckets[-1].numel += numel
        return buckets

    def _pseudo_gradient(self, bucket: _Bucket) -> torch.Tensor:
        """This replica's phi - theta over the bucket, flat fp32."""
        return torch.cat([(self._snapshot[i] - self._value(i).float()).reshape(-1)
                          for i in bucket.indices])

    def _unflatten(self, flat: torch.Tensor, bucket: _Bucket):
        offset = 0
        for i in bucket.indices:
            numel = self._snapshot[i].numel()
            yield i, flat[offset:offset + numel].view_as(self._snapshot[i])
            offset += numel

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer state (views, not copies: save them before the next outer step). co2's
        in-flight all-reduce is waited for first, so its average is saved, not lost."""
        self.finish()
        state: dict[str, Any] = {
            "mode": self.mode,
            "inner_steps": self.inner_steps,
            "outer_step_count": list(self.outer_step_count),
            "snapshot": self._by_name(self._snapshot),
            "momentum": self._by_name(self._momentum),
        }
        if self.mode == "co2":
            state["displacement"] = self._by_name(self._displacement)
            state["pending"] = self._by_name(self._pending_view)
            state["has_pending"] = self.has_pending
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (tensors or DTensors of the current layout, e.g.
        filled in place by DCP), copying into this object's buffers."""
        if state["mode"] != self.mode:
            raise ValueError(f"state_dict: saved by mode {state['mode']!r}, loading into mode "
                             f"{self.mode!r}")
        if len(state["outer_step_count"]) != self.fragments:
            raise ValueError(f"state_dict: saved with fragments={len(state['outer_step_count'])}"
                             f", loading with fragments={self.fragments}")
        tensors = [("snapshot", self._snapshot), ("momentum", self._momentum)]
        if self.mode == "co2":
            self.finish()
            tensors += [("displacement", self._displacement), ("pending", self._pending_view)]
        with torch.no_grad():
            for key, targets in tensors:
                saved = state[key]
                missing = [n for n in self.names if n not in saved]
                if missing:
                    raise ValueError(f"state_dict[{key!r}] has no entry for parameters "
                                     f"{missing[:3]}{' ...' if len(missing) > 3 else ''}")
                for name, target in zip(self.names, targets):
                    target.copy_(local_shard(saved[name]))
        self.inner_steps = int(state["inner_steps"])
        self.outer_step_count = [int(n) for n in state["outer_step_count"]]
        if self.mode == "co2":
            self.has_pending = bool(state["has_pending"])

    def _by_name(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, param, tensor in zip(self.names, self.params, tensors):
            if isinstance(param, DTensor):  # the same sharding, so DCP can reshard it
                tensor = DTensor.from_local(tensor, param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape,
                                            stride=param.stride())
            out[name] = tensor
        return out
