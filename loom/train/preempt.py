"""Graceful preemption and Ctrl-C on the rank side.

Spot instances, Slurm and Kubernetes send SIGTERM some seconds before they kill a job. A worker
of ``loom train`` (``loom.launch.worker_main``) installs ``install_handlers``: SIGTERM only sets a
flag. After every step ``Trainer.fit`` all-reduces that flag (MAX of one int over the world), so
all ranks see the stop at the *same* step even though the signal reached one of them; they then
save a checkpoint to ``run_dir/checkpoints`` (whatever ``checkpoint.interval`` says), log
"preempted at step N: ...", and return normally: the job exits 0 and ``--resume auto`` continues
bit for bit. Until training starts (``arm``, after the Trainer is built) a SIGTERM ends
the worker with exit code 143 instead: nothing is trained yet, and a worker blocked in the
rendezvous (a peer that never comes) would never reach a step that reads the flag. The launcher forwards its own SIGTERM to the workers and kills them only when
``train.preempt_grace_s`` runs out (``loom.supervise``).

SIGINT (Ctrl-C, sent by a terminal to the whole process group, or forwarded by the launcher, or by
torch's parent-death signal when the launcher died) ends the worker at once with exit code 130
and no traceback: an interrupt is not a preemption, nothing is saved, and the launcher prints the
one line the user sees.

Why hand-written: torch elastic turns a signal into ``SignalException`` in the agent and then
SIGTERM-then-SIGKILLs the workers; what a worker does with the SIGTERM, and agreeing on the step
across ranks, is up to the training loop.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

_requested = False
_armed = False  # set by ``arm`` when training starts: before it, SIGTERM ends the worker


def install_handlers() -> None:
    """In a worker's main thread: SIGTERM requests a stop (once ``arm``ed; before that it
    exits 143 at once), SIGINT exits 130 quietly."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)


def arm() -> None:
    """Training starts: from now on a SIGTERM asks the loop to checkpoint at the next step.
    Before, nothing is trained that a checkpoint would keep, and the worker may be blocked
    where no step will ever check the flag (a rendezvous waiting for a peer that never comes),
    so a SIGTERM there ends it like the default action would."""
    global _armed
    _armed = True


def _on_sigterm(signum, frame) -> None:
    if not _armed:
        _flush_and_exit(128 + signal.SIGTERM)
    request_stop()


def _on_sigint(signum, frame) -> None:
    _flush_and_exit(130)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def finished() -> None:
    """The worker's work is done (trained or preempted, everything saved): ignore SIGTERM from
    now on. Python restores the default action of the signals it handles when the interpreter
    shuts down (not of ignored ones), and a shutdown with torch loaded takes long enough for a
    late SIGTERM to turn a finished worker into one killed by a signal: a failed job."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def request_stop() -> None:
    """Ask the training loop to checkpoint and stop after the current step (what SIGTERM does)."""
    global _requested
    _requested = True


def stop_requested() -> bool:
    return _requested


def reset() -> None:
    global _requested, _armed
    _requested = _armed = False


def agree_to_stop(local: bool, device: torch.device) -> bool:
    """True on every rank when any rank asked to stop (a collective over the default group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
