"""What SIGTERM does to a worker: before training starts it ends the worker (exit 143, as the
default action would: nothing is trained yet, and a worker waiting in the rendezvous for a peer
that never comes reads no flag); once ``preempt.arm`` ran it only asks for a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from loom.train import preempt
    preempt.install_handlers()
    if sys.argv[1] == "armed":
        preempt.arm()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # the handler runs between bytecodes
    print("stop requested" if preempt.stop_requested() else "still running")
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("state, code, said", [("before", 143, ""),
                                               ("armed", 0, "stop requested")])
def test_sigterm_ends_a_worker_before_training_and_asks_for_a_checkpoint_after(state, code,
                                                                               said):
    done = subprocess.run([sys.executable, "-c", _WORKER, state], capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == code, done.stderr
    assert done.stdout.strip() == said
