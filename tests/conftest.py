"""Shared fixtures: the multi-process worker pools and a small prepared corpus.

``dist`` is a ``loom.testing.harness.PoolRegistry`` shared by the whole session: ``dist.run(W,
fn, *args)`` runs ``fn(ctx, *args)`` on W long-lived gloo ranks and returns their results, so
process groups are started once per world size, not once per test.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path
from types import ModuleType

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # before any worker is forked or spawned

from loom.testing.harness import PoolRegistry  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """A bench script (``bench/<name>.py``, not a package module) loaded from its path."""
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matrix(cases, ci: list) -> list:
    """``cases`` for ``pytest.mark.parametrize`` with every case not in ``ci`` marked ``matrix``.

    The parity matrices cross every axis with every other; CI (a 25-minute budget on 2 cores)
    runs the cases in ``ci``, chosen so that each axis, each ZeRO stage and each pair the
    feature composes with still runs at least once, and ``python -m pytest -m matrix`` runs the
    rest. A case is a value or a tuple of the parametrized arguments."""
    cases = list(cases)
    unknown = [case for case in ci if case not in cases]
    if unknown:
        raise ValueError(f"matrix: CI cases {unknown} are not among the cases")
    return [case if case in ci else
            pytest.param(*(case if isinstance(case, tuple) else (case,)),
                         marks=pytest.mark.matrix)
            for case in cases]


@pytest.fixture(scope="session")
def dist():
    registry = PoolRegistry(pg_timeout_s=120.0)  # short enough to fail fast, long enough for a loaded 2-core box
    yield registry
    registry.close()


class _SmallData:
    source = "stdlib"
    extensions = (".py",)
    tokenizer = "byte"
    bpe_vocab_size = 2048
    seq_len = 32
    val_fraction = 0.05
    max_bytes = 200_000


@pytest.fixture(scope="session")
def small_data_dir(tmp_path_factory) -> str:
    """Byte-tokenized first ~200 kB of the standard library, sequences of 32 tokens."""
    from loom.data.loader import prepare_data

    out = tmp_path_factory.mktemp("data")
    prepare_data(_SmallData(), out)
    return str(out)


SMALL_DATA_OVERRIDES = {"data.seq_len": _SmallData.seq_len, "data.max_bytes": _SmallData.max_bytes,
                        "data.extensions": ",".join(_SmallData.extensions)}


@pytest.fixture(autouse=True)
def _signal_dispositions_restored():
    """A test that runs ``loom.cli.main`` in process leaves the launcher's exit disposition
    behind (a finished job ignores a late SIGTERM); ignored signals survive fork and exec, so
    every later subprocess and forked worker would inherit it. Each test starts from the
    dispositions the session started with."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)
