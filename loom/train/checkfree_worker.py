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
from loom.train.checkfree import (BLOCK, STORE_PREFIX, blocks_grad_norm, failed_key,
                                  neighbour_average, neighbour_weights, stage_blocks)
from loom.train.distributed import DistContext, init_distributed, resolve_backend, resolve_device
from loom.train.trainer import Trainer

JOIN_WAIT_S = 300.0  # how long the ranks of a generation wait for each other to arrive
RECOVERY_WAIT_S = 60.0  # how long a rank whose step failed waits for the launcher's next generation


# -- the trainer with what recovery needs ---------------------------------------------------------
class CheckFreeTrainer(Trainer):
    """A ``Trainer`` that also records, every step, its blocks' gradient norm (the weight its
    stage gets in a neighbour's rebuild) and its data position with the step it belongs to, and
    that injects the test kill of ``fault.test_kill_stage``."""

    def __init__(self, config: Config, data_dir: str | Path, run_dir: str | Path,
                 ctx: DistContext, *, generation: int) -> None:
        super().__init__(config, data_dir, run_dir, ctx)
        self.generation = generation
        self.stage = self.grid.coords(ctx.rank)["pp"]
        self.last_grad_norm = 0.0
        self.data_at: tuple[int, dict[str, int]] = (self.step, self.loader.state_dict())

    def train_step(self) -> dict[str, float]:
        fault = self.config.fault
        kill = fault.test_kill_step * (self.generation + 1)
        if (self.stage == fault.test_kill_stage and self.generation < fault.test_kill_count
                and self.step + 1 == kill):
            print(f"checkfree: test kill of stage {self.stage} (rank {self.ctx.rank}, pid"
                  f" {os.getpid()}) at the start of step {kill}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.data_at = (self.step, self.loader.state_dict())
        metrics = super().train_step()
        self.last_grad_norm = blocks_grad_norm(self.model)
        self.data_at = (self.step, self.loader.state_dict())
        return metrics


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


def snapshot(trainer: CheckFreeTrainer) -> Snapshot:
    data_step, data = trainer.data_at
    if trainer.step == data_step + 1:  # the step failed after its optimizer step (in a later
        data = trainer.loader.state_dict()  # collective): its batch is consumed too
    elif trainer.step != data_step:
        raise RuntimeError(f"data position of step {data_step}, weights of step {trainer.step}")
    return Snapshot(trainer.step, {k: v.detach() for k, v in trainer.model.state_dict().items()},
                    trainer.optimizer.state_dict(), trainer.scheduler.state_dict(), data,
                    trainer.skipped_steps, trainer.last_grad_norm)


def _restore(trainer: CheckFreeTrainer, snap: Snapshot) -> None:
    trainer.model.load_state_dict(snap.weights)
    trainer.optimizer.load_state_dict(snap.optimizer)  # param groups' lr included
    trainer.scheduler.load_state_dict(snap.scheduler)
    trainer.loader.load_state_dict(snap.data)
    trainer.step, trainer.skipped_steps = snap.step, snap.skipped_steps
    trainer.last_grad_norm = snap.grad_norm
    trainer.data_at = (trainer.step, trainer.loader.state_dict())


# -- the collective rebuild -----------------------------------------------------------------------
def rebuild(trainer: CheckFreeTrainer, failed: int, snap: Snapshot | None,
            log: Callable[[str], None], dump_dir: Path | None = None) -> dict[str, Any]:
    """Collective over the new group: survivors restore ``snap``; ranks ``failed - 1`` and
    ``failed + 1`` send their state and blocks to ``failed`` (the replacement, ``snap`` None),
    which loads the neighbours' weighted average into its blocks. Returns what the replacement
    computed (empty elsewhere). ``dump_dir``: each neighbour writes what it sent, the replacement
    what it loaded, for tests."""
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
    prev, nxt = failed - 1, failed + 1
    if rank in (prev, nxt):
        blocks = stage_blocks(trainer.model)
        header = [{"step": trainer.step, "scheduler": trainer.scheduler.state_dict(),
                   "data": trainer.loader.state_dict(), "skipped_steps": trainer.skipped_steps,
                   "grad_norm": trainer.last_grad_norm,
                   "shapes": {k: tuple(v.shape) for k, v in blocks.items()}}]
        dist.send_object_list(header, dst=failed)
        for key in sorted(blocks):
            dist.send(blocks[key].detach().contiguous(), dst=failed)
        if dump_dir is not None:
            torch.save({"stage": trainer.stage, "grad_norm": trainer.last_grad_norm,
                        "step": trainer.step,
                        "blocks": {k: v.detach().cpu().clone() for k, v in blocks.items()}},
                       dump_dir / f"gen{trainer.generation}_rank{rank}_sent.pt")
        return {}
    if not replacement:
        return {}
    mine = stage_blocks(trainer.model)
    others = [name for name in dict(trainer.model.named_parameters()) if not BLOCK.match(name)]
    if others:
        raise RuntimeError(f"checkfree: stage {trainer.stage} holds more than blocks ({others});"
                           " only a middle stage can be rebuilt")
    received = []
    for src in (prev, nxt):
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
    (head_prev, prev_blocks), (head_next, next_blocks) = received
    if head_prev["step"] != head_next["step"]:
        raise RuntimeError(f"checkfree: neighbours at steps {head_prev['step']} and"
                           f" {head_next['step']}")
    w_prev, w_next = neighbour_weights(head_prev["grad_norm"], head_next["grad_norm"])
    averaged = neighbour_average(prev_blocks, next_blocks, w_prev, w_next)
    with torch.no_grad():
        for key, param in mine.items():
            param.copy_(averaged[key].to(device))
    # the optimizer is the new Trainer's: empty moments, step counts from zero (the paper's
    # reset); the schedule and the data continue where the neighbours are
    trainer.scheduler.load_state_dict(head_prev["scheduler"])
    for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr()):
        group["lr"] = lr
    trainer.loader.load_state_dict(head_prev["data"])
    trainer.step, trainer.skipped_steps = head_prev["step"], head_prev["skipped_steps"]
    trainer.data_at = (trainer.step, trainer.loader.state_dict())
    log(f"checkfree: stage {trainer.stage} (rank {rank}) rebuilt after step {trainer.step} from"
        f" stages {prev} and {nxt}: weights {w_prev / (w_prev + w_next):.4f} /"
        f" {w_next / (w_prev + w_next):.4f} (their gradient norms {head_prev['grad_norm']:.4g},"
        f" {head_next['grad_norm']:.4g}); optimizer state reset; no checkpoint read")
    if dump_dir is not None:
        torch.save({"stage": trainer.stage, "step": trainer.step, "w_prev": w_prev,
                    "w_next": w_next,
                    "blocks": {k: p.detach().cpu().clone() for k, p in mine.items()}},
                   dump_dir / f"gen{trainer.generation}_rank{rank}_rebuilt.pt")
    return {"w_prev": w_prev, "w_next": w_next, "step": trainer.step}


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
