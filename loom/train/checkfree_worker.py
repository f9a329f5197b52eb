"""The trainer side of CheckFree recovery (``loom.train.checkfree`` describes the protocol): a
``Trainer`` that records what a rebuild needs, the in-memory ``Snapshot`` of a survivor, the
collective ``rebuild`` over a new process group, and ``run_worker``, one rank's life across
recovery generations. Hand-written for the reasons given there.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.config import Config
from loom.config import model_args
from loom.models import build_model
from loom.train.checkfree import (BLOCK, STORE_PREFIX, blocks_grad_norm, copy_target,
                                  failed_key, neighbour_average, neighbour_weights,
                                  recovery_sources, scaled_schedule, stage_blocks)
from loom.train.distributed import DistContext, init_distributed, resolve_backend, resolve_device
from loom.train.trainer import Trainer

JOIN_WAIT_S = 300.0  # how long the ranks of a generation wait for each other to arrive
RECOVERY_WAIT_S = 60.0  # how long a rank whose step failed waits for the launcher's next generation


# -- the trainer with what recovery needs ---------------------------------------------------------
class CheckFreeTrainer(Trainer):
    """A ``Trainer`` that also records, every step, its blocks' gradient norm (the weight its
    stage gets in a neighbour's rebuild) and its data position with the step it belongs to;
    under checkfree_plus keeps its neighbour's end copy up to date (``exchange_end_copies``);
    and injects the test kills of ``fault.test_kill_stage(s)``."""

    def __init__(self, config: Config, data_dir: str | Path, run_dir: str | Path,
                 ctx: DistContext, *, generation: int) -> None:
        super().__init__(config, data_dir, run_dir, ctx)
        self.generation = generation
        self.stage = self.grid.coords(ctx.rank)["pp"]
        self.num_stages = config.parallel.pp
        self.last_grad_norm = 0.0
        self.data_at: tuple[int, dict[str, int]] = (self.step, self.loader.state_dict())
        self.lr_scale = 1.0  # fault.recovery_lr_scale once this rank was rebuilt
        # checkfree_plus, on stage 1 (pp - 2): the copy of stage 0's embedding (of the last
        # stage's norm and head) and the step it is from
        self.end_copy: dict[str, torch.Tensor] | None = None
        self.end_copy_step = -1
        self.plus = config.fault.recovery == "checkfree_plus"
        if self.plus:
            for source in (0, self.num_stages - 1):
                target, names = copy_target(source, self.num_stages)
                if target == self.stage:
                    shapes = dict(build_model(model_args(config), device="meta", layer_ids=[])
                                  .named_parameters())
                    self.end_copy = {n: torch.zeros(shapes[n].shape, device=ctx.device)
                                     for n in names}
                    self.end_copy_source = source

    def kill_schedule(self) -> tuple[int, ...]:
        """The stage killed in each generation (``fault.test_kill_stages``, or
        ``test_kill_stage`` ``test_kill_count`` times)."""
        fault = self.config.fault
        return fault.test_kill_stages or (fault.test_kill_stage,) * fault.test_kill_count

    def kill_steps(self) -> tuple[int, ...]:
        """The step at whose start each generation's kill lands (``fault.test_kill_steps``, or
        every ``test_kill_step`` steps)."""
        fault = self.config.fault
        return fault.test_kill_steps or tuple(
            fault.test_kill_step * (g + 1) for g in range(len(self.kill_schedule())))

    def train_step(self) -> dict[str, float]:
        kills, steps = self.kill_schedule(), self.kill_steps()
        kill = steps[self.generation] if self.generation < len(steps) else -1
        if (self.generation < len(kills) and self.stage == kills[self.generation]
                and self.step + 1 == kill):
            print(f"checkfree: test kill of stage {self.stage} (rank {self.ctx.rank}, pid"
                  f" {os.getpid()}) at the start of step {kill}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.data_at = (self.step, self.loader.state_dict())
        metrics = super().train_step()
        self.last_grad_norm = blocks_grad_norm(self.model)
        self.data_at = (self.step, self.loader.state_dict())
        if self.plus:
            self.exchange_end_copies()
        return metrics

    def exchange_end_copies(self) -> None:
        """CheckFree+, after each optimizer step: stage 0 sends its embedding to stage 1, the
        last stage its norm and head to stage pp-2, which keep them (point to point; the
        other stages do nothing). With ``fault.dump_recovery`` the senders write what they
        sent (``step<k>_rank<r>_end.pt``), for tests."""
        target = copy_target(self.stage, self.num_stages)
        if target is not None:
            dst, names = target
            params = dict(self.model.named_parameters())
            for tag, name in enumerate(names):
                dist.send(params[name].detach().contiguous(), dst=dst, tag=tag)
            if self.config.fault.dump_recovery and self.run_dir is not None:
                torch.save({"step": self.step,
                            "end": {n: params[n].detach().cpu().clone() for n in names}},
                           self.run_dir / "checkfree"
                           / f"step{self.step}_rank{self.ctx.rank}_end.pt")
        if self.end_copy is not None:
            for tag, name in enumerate(self.end_copy):
                dist.recv(self.end_copy[name], src=self.end_copy_source, tag=tag)
            self.end_copy_step = self.step


@dataclasses.dataclass
class Snapshot:
    """A survivor's state at its last completed step, in memory (references, not copies: the
    trainer it came from is dropped)."""
    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    data: dict[str, int]
    skipped_steps: int
    grad_norm: float
    lr_scale: float = 1.0
    end_copy: dict[str, torch.Tensor] | None = None
    end_copy_step: int = -1


def snapshot(trainer: CheckFreeTrainer) -> Snapshot:
    data_step, data = trainer.data_at
    if trainer.step == data_step + 1:  # the step failed after its optimizer step (in a later
        data = trainer.loader.state_dict()  # collective): its batch is consumed too
    elif trainer.step != data_step:
        raise RuntimeError(f"data position of step {data_step}, weights of step {trainer.step}")
    return Snapshot(trainer.step, {k: v.detach() for k, v in trainer.model.state_dict().items()},
                    trainer.optimizer.state_dict(), trainer.scheduler.state_dict(), data,
                    trainer.skipped_steps, trainer.last_grad_norm, trainer.lr_scale,
                    trainer.end_copy, trainer.end_copy_step)


def _restore(trainer: CheckFreeTrainer, snap: Snapshot) -> None:
    trainer.model.load_state_dict(snap.weights)
    trainer.optimizer.load_state_dict(snap.optimizer)  # param groups' lr included
    trainer.scheduler.load_state_dict(snap.scheduler)
    trainer.loader.load_state_dict(snap.data)
    trainer.step, trainer.skipped_steps = snap.step, snap.skipped_steps
    trainer.last_grad_norm, trainer.lr_scale = snap.grad_norm, snap.lr_scale
    if snap.end_copy is not None:
        trainer.end_copy, trainer.end_copy_step = snap.end_copy, snap.end_copy_step
    trainer.data_at = (trainer.step, trainer.loader.state_dict())


# -- the collective rebuild -----------------------------------------------------------------------
def rebuild(trainer: CheckFreeTrainer, failed: int, snap: Snapshot | None,
            log: Callable[[str], None], dump_dir: Path | None = None) -> dict[str, Any]:
    """Collective over the new group: survivors restore ``snap``; the stages the lost one is
    rebuilt from (``recovery_sources``: both neighbours of a middle stage; under checkfree_plus
    the one neighbour of the first or last stage, with its end copy) send their state and blocks
    to ``failed`` (the replacement, ``snap`` None), which loads the neighbours' weighted average
    (or the one neighbour's copy) into its blocks, with a fresh optimizer and its schedule scaled
    by ``fault.recovery_lr_scale``. Returns what the replacement computed (empty elsewhere).
    ``dump_dir``: each source writes what it sent, the replacement what it loaded, for tests."""
    rank, device = trainer.ctx.rank, trainer.ctx.device
    replacement = snap is None
    if replacement != (rank == failed):
        raise RuntimeError(f"rank {rank}: {'no state' if replacement else 'a state'} to restore,"
                           f" but rank {failed} is the one replaced")
    if not replacement:
        _restore(trainer, snap)
    # every survivor must be at the same step (the failed step was applied nowhere)
    steps = torch.tensor([trainer.step if not replacement else -1], dtype=torch.int64)
    low = torch.tensor([trainer.step if not replacement else 2 ** 62], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if int(steps) != int(low):
        raise RuntimeError(f"checkfree: the surviving ranks stopped at different steps"
                           f" ({int(low)} .. {int(steps)}): an optimizer step was applied on some"
                           " ranks only, which averaging cannot repair")
    recovery = trainer.config.fault.recovery
    sources = recovery_sources(recovery, failed, trainer.num_stages)
    end_names = () if len(sources) == 2 else copy_target(failed, trainer.num_stages)[1]
    if rank in sources:
        blocks = stage_blocks(trainer.model)
        end = None
        if end_names:  # the lost stage's embedding or head: this rank's copy
            if trainer.end_copy is None or set(trainer.end_copy) != set(end_names):
                raise RuntimeError(f"checkfree_plus: stage {trainer.stage} holds no copy of"
                                   f" {list(end_names)} to rebuild stage {failed} with")
            end = {k: v.detach().cpu().clone() for k, v in trainer.end_copy.items()}
        header = [{"step": trainer.step, "scheduler": trainer.scheduler.state_dict(),
                   "lr": trainer.optimizer.param_groups[0]["lr"],
                   "data": trainer.loader.state_dict(), "skipped_steps": trainer.skipped_steps,
                   "grad_norm": trainer.last_grad_norm, "end": end,
                   "end_step": trainer.end_copy_step,
                   "shapes": {k: tuple(v.shape) for k, v in blocks.items()}}]
        dist.send_object_list(header, dst=failed)
        for key in sorted(blocks):
            dist.send(blocks[key].detach().contiguous(), dst=failed)
        if dump_dir is not None:
            torch.save({"stage": trainer.stage, "grad_norm": trainer.last_grad_norm,
                        "step": trainer.step, "lr": header[0]["lr"], "end": end,
                        "end_step": trainer.end_copy_step,
                        "blocks": {k: v.detach().cpu().clone() for k, v in blocks.items()}},
                       dump_dir / f"gen{trainer.generation}_rank{rank}_sent.pt")
        return {}
    if not replacement:
        return {}
    mine = stage_blocks(trainer.model)
    params = dict(trainer.model.named_parameters())
    others = sorted(name for name in params if not BLOCK.match(name))
    if others != sorted(end_names):
        raise RuntimeError(f"checkfree: stage {trainer.stage} holds {others} besides its blocks;"
                           f" a rebuild from stages {list(sources)} restores {list(end_names)}")
    received = []
    for src in sources:
        header = [None]
        dist.recv_object_list(header, src=src)
        head = header[0]
        if head["shapes"] != {k: tuple(v.shape) for k, v in mine.items()}:
            raise RuntimeError(f"checkfree: stage of rank {src} has blocks {head['shapes']},"
                               f" the lost stage {({k: tuple(v.shape) for k, v in mine.items()})}")
        tensors = {}
        for key in sorted(mine):
            buf = torch.empty_like(mine[key].detach())
            dist.recv(buf, src=src)
            tensors[key] = buf
        received.append((head, tensors))
    if any(head["step"] != received[0][0]["step"] for head, _ in received):
        raise RuntimeError(f"checkfree: sources at steps {[h['step'] for h, _ in received]}")
    head_prev = received[0][0]
    result: dict[str, Any] = {"step": head_prev["step"], "sources": list(sources)}
    if len(sources) == 2:
        (_, prev_blocks), (head_next, next_blocks) = received
        w_prev, w_next = neighbour_weights(head_prev["grad_norm"], head_next["grad_norm"])
        rebuilt = neighbour_average(prev_blocks, next_blocks, w_prev, w_next)
        result.update(w_prev=w_prev, w_next=w_next)
        how = (f"from stages {sources[0]} and {sources[1]}: weights"
               f" {w_prev / (w_prev + w_next):.4f} / {w_next / (w_prev + w_next):.4f} (their"
               f" gradient norms {head_prev['grad_norm']:.4g}, {head_next['grad_norm']:.4g})")
    else:  # CheckFree+: the neighbour's blocks as they are, and its copy of the end
        rebuilt = received[0][1]
        end = head_prev["end"]
        with torch.no_grad():
            for name in end_names:
                params[name].copy_(end[name].to(device))
        how = (f"from stage {sources[0]}: a copy of its blocks and of its copy of"
               f" {', '.join(end_names)} (taken after step {head_prev['end_step']})")
    with torch.no_grad():
        for key, param in mine.items():
            param.copy_(rebuilt[key].to(device))
    # the optimizer is the new Trainer's: empty moments, step counts from zero (the paper's
    # reset); the schedule continues where the sources are, scaled by fault.recovery_lr_scale
    scale = trainer.config.fault.recovery_lr_scale
    scheduler = trainer.scheduler
    scheduler.load_state_dict(scaled_schedule(scheduler.state_dict(), head_prev["scheduler"],
                                              scale))
    lrs = [base * fn(scheduler.last_epoch)
           for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(trainer.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    trainer.lr_scale = scale
    trainer.loader.load_state_dict(head_prev["data"])
    trainer.step, trainer.skipped_steps = head_prev["step"], head_prev["skipped_steps"]
    trainer.data_at = (trainer.step, trainer.loader.state_dict())
    log(f"{recovery}: stage {trainer.stage} (rank {rank}) rebuilt after step {trainer.step} {how};"
        f" optimizer state reset; learning rate x{scale:g} ({lrs[0]:.4g}, the sources'"
        f" {head_prev['lr']:.4g}); no checkpoint read")
    result.update(lr=lrs[0], source_lr=head_prev["lr"], scale=scale,
                  optimizer_states=len(trainer.optimizer.state))
    if dump_dir is not None:
        torch.save({**result, "stage": trainer.stage,
                    "end": {n: params[n].detach().cpu().clone() for n in end_names},
                    "blocks": {k: p.detach().cpu().clone() for k, p in mine.items()}},
                   dump_dir / f"gen{trainer.generation}_rank{rank}_rebuilt.pt")
    return result


# -- one worker, across generations ---------------------------------------------------------------
def _wait_for_key(store: dist.Store, key: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        time.sleep(0.05)
    return False


def _init_group(config: Config, store: dist.Store, generation: int, rank: int,
                world_size: int) -> DistContext:
    tr = config.train
    # Everyone arrives first, with no deadline but the join wait (start-up and a replacement's
    # imports can take minutes on a loaded machine); the group's own timeout, train.timeout_s,
    # is then what bounds each collective, short enough to notice a lost peer.
    arrived = f"{STORE_PREFIX}/gen{generation}/arrived"
    store.add(arrived, 1)
    deadline = time.monotonic() + JOIN_WAIT_S
    while store.add(arrived, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {generation}: only {store.add(arrived, 0)} of"
                               f" {world_size} ranks arrived within {JOIN_WAIT_S:.0f} s")
        time.sleep(0.05)
    device = resolve_device(tr.device, int(os.environ.get("LOCAL_RANK", rank)))
    backend = resolve_backend(tr.backend, device)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{STORE_PREFIX}/gen{generation}/pg",
                                                            store),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=tr.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return init_distributed(tr.device, tr.backend, tr.timeout_s, tr.threads)


def run_worker(config: Config, run_dir: Path, store: dist.Store, rank: int, world_size: int,
               generation: int, log: Callable[[str], None] = print) -> dict[str, float]:
    """Train as rank ``rank`` of generation ``generation`` (> 0 with no state: the replacement of
    the rank that generation names) until the run ends, surviving the loss of middle stages."""
    snap: Snapshot | None = None
    dump_dir = Path(run_dir) / "checkfree" if config.fault.dump_recovery else None
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
    while True:
        ctx = _init_group(config, store, generation, rank, world_size)
        run_config = config
        if generation > 0:  # the state is in memory (or the neighbours'): never a checkpoint
            run_config = dataclasses.replace(
                config, checkpoint=dataclasses.replace(config.checkpoint, resume=""))
        trainer = CheckFreeTrainer(run_config, Path(run_dir) / "data", run_dir, ctx,
                                   generation=generation)
        if generation > 0:
            failed = int(store.get(failed_key(generation)).decode())
            rebuild(trainer, failed, snap, log, dump_dir)
        snap = None
        try:
            metrics = trainer.fit()
        except Exception as err:  # a dead peer, or a real error: the launcher's store tells
            if not _wait_for_key(store, failed_key(generation + 1), RECOVERY_WAIT_S):
                raise
            failed = int(store.get(failed_key(generation + 1)).decode())
            text = str(err).strip()
            detail = text.splitlines()[0][:160] if text else type(err).__name__
            log(f"checkfree: rank {rank} (stage {trainer.stage}) stopped in step"
                f" {trainer.step + 1}: rank {failed} was lost ({detail}); keeping this rank's"
                f" state in memory and joining generation {generation + 1}")
            snap = snapshot(trainer)
        else:
            dist.destroy_process_group()
            return metrics
        # Out of the except block, so the traceback (whose frames hold the trainer) is gone:
        # dropping the last references to the old groups closes their sockets now, which is how
        # ranks still waiting on this one learn of the failure without waiting for the timeout.
        del trainer
        dist.destroy_process_group()
        gc.collect()
        generation += 1
