"""Crash-consistent, verifiable, safely loaded distributed checkpoints.

A checkpoint of step N is the directory ``<root>/step_<N:08d>``:

* the sharded tensors (model and optimizer), written by ``torch.distributed.checkpoint`` (DCP), so
  any layout can load what any other layout saved (DCP reshards by fully qualified names);
* ``extra.json``: plain data (step, LR schedule, data-loader position, resolved config ...);
* ``rng/rank<R>.pt``: each rank's random-number-generator states (tensors only);
* ``manifest.json``: the SHA-256 and size of every file above;
* ``COMMITTED``: written last. A checkpoint counts only when this marker exists.

Writing goes to ``step_<N>.partial`` and is renamed into place only after the marker is written,
so a crash at any point leaves either a complete checkpoint or a ``.partial`` directory that
``latest_complete`` ignores (and the next save of that step removes).

Loading refuses what it cannot trust: a missing, truncated or altered file (the manifest's size
and SHA-256 do not match), and anything that would execute code when unpickled. DCP reads its
tensors with ``torch.load(weights_only=True)``, but it reads its ``.metadata`` file with plain
``pickle.load``; Loom first unpickles that file with an allow-list of DCP's metadata classes and
refuses the checkpoint if the pickle names anything else. DCP also stores non-tensor values
(hyper-parameters such as ``lr`` and ``betas``) as pickles and unpickles them with
``weights_only=False``; Loom's load planner reads them with ``weights_only=True``, so a crafted
value is refused instead of run. RNG files are read with ``weights_only=True``. This module is Loom's own because DCP leaves commit markers, checksums,
retention and safe metadata to the caller.

Asynchronous saving (``save(async_save=True)``, ``checkpoint.async_save``): DCP's ``async_save``
copies the tensors to CPU memory before returning (the only part training waits for, besides a
barrier and the small files), then writes them from a background thread. The commit (manifest,
marker, rename, retention) runs on the main rank only after that write has finished on every
rank, so the crash-consistency above holds unchanged: a kill during the background write leaves
``step_<N>.partial`` without a marker, and the previous checkpoint stays the newest complete one.
Retention only ever deletes committed checkpoints, so it never touches one being written.

Collectives: ``save`` and ``load`` are collective over the given process group (every rank calls
them): DCP's own planning collectives, plus barriers and a broadcast of the verification verdict.
An asynchronous save runs DCP's collectives (a gather and a scatter of the save plans, a gather
of the write results: small objects) in the background thread on a separate gloo group over the
same ranks, created by the first asynchronous save.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
EXTRA = "extra.json"
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupted or unsafe; the message says which file and why."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
             and (p / COMMIT_MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, COMMIT_MARKER))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Verification


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` only if it names nothing beyond DCP's own plain classes."""

    _ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",
                        "torch.distributed.checkpoint.planner")
    _ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"),
                ("torch", "layout"), ("torch", "memory_format"), ("builtins", "set"),
                ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "bytes"),
                ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._ALLOWED_MODULES or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"refusing to load: the checkpoint metadata pickle names {module}.{name},"
                              " which is not a DCP metadata class (it could execute code)")


def check_metadata_is_safe(path: Path) -> None:
    """Raise CheckpointError unless ``path/.metadata`` unpickles with the allow-list."""
    metadata = Path(path) / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"{path}: no DCP .metadata file")
    try:
        _MetadataUnpickler(io.BytesIO(metadata.read_bytes())).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated or garbage pickle
        raise CheckpointError(f"{metadata}: unreadable metadata ({err})") from None


def verify(path: Path) -> dict[str, Any]:
    """Check the commit marker, every file's size and SHA-256, and the metadata's safety.

    Returns the manifest; raises CheckpointError naming the first bad file.
    """
    path = Path(path)
    if not (path / COMMIT_MARKER).is_file():
        raise CheckpointError(f"{path}: incomplete (no {COMMIT_MARKER} marker)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / MANIFEST}: unreadable manifest ({err})") from None
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file}: truncated or altered ({size} bytes, expected"
                                  f" {entry['size']})")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: corrupted (SHA-256 does not match the manifest)")
    extra_files = {str(p.relative_to(path)) for p in _files(path)} - set(manifest["files"])
    if extra_files:
        raise CheckpointError(f"{path}: files not in the manifest: {sorted(extra_files)}")
    check_metadata_is_safe(path)
    return manifest


# ---------------------------------------------------------------------------------------------
# Saving and loading


def _is_main(group: Any) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group: Any) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank(group: Any) -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class PendingSave:
    """A checkpoint whose tensors are being written in the background (``save(async_save=True)``).

    ``path`` is where it will be once committed; ``wait()`` blocks until the write and (on the
    main rank) the commit have finished, re-raising any error of either."""

    def __init__(self, path: Path, future: Future) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Path:
        self._future.result()
        return self.path


class _Stager:
    """DCP's default CPU staging, plus the ShardedTensors Loom builds (ZeRO-1/2 slices, expert
    slices), which DCP's stager cannot copy. Synchronous: the copy is complete on return."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._default = DefaultStager(StagingOptions(use_pinned_memory=False,
                                                     use_shared_memory=False,
                                                     use_async_staging=False,
                                                     use_non_blocking_copy=False))

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from loom.train.checkpoint_state import is_sharded_tensor, sharded_tensor_to_cpu

        plain = {part: {k: v for k, v in values.items() if not is_sharded_tensor(v)}
                 for part, values in state.items()}
        staged = self._default.stage(plain)
        for part, values in state.items():
            staged[part].update({k: sharded_tensor_to_cpu(v) for k, v in values.items()
                                 if is_sharded_tensor(v)})
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._default.close()


_ASYNC_GROUPS: dict[Any, Any] = {}


def _async_group(group: Any) -> Any:
    """A gloo group over the same ranks for the background writer's collectives (created once,
    collectively). DCP's planning and finishing collectives then run in the writer thread while
    training issues its own on the other groups; sharing one group between two threads could
    interleave their collectives."""
    if not dist.is_initialized():
        return None
    if group is not None:
        raise ValueError("asynchronous checkpoints are written by every rank of the job"
                         " (group=None)")
    if None not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[None] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[None]


def _commit(root: Path, partial: Path, final: Path, step: int, keep: int) -> None:
    """Main rank, after every rank's files are on disk: manifest, marker, rename, retention.
    Retention only ever removes committed checkpoints, never one still being written."""
    files = {str(p.relative_to(partial)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(partial)}
    _write_atomic(partial / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
    _write_atomic(partial / COMMIT_MARKER, json.dumps({"step": step, "time": time.time()}))
    if final.exists():  # an older save of the same step (e.g. after a restart)
        shutil.rmtree(final)
    os.replace(partial, final)
    if keep > 0:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def save(root: Path, step: int, tensors: dict[str, Any], extra: dict[str, Any], *,
         keep: int = 0, device: torch.device = torch.device("cpu"), group: Any = None,
         async_save: bool = False) -> Path | PendingSave:
    """Write step ``step`` (collective); keep the newest ``keep`` complete ones (0: all).

    ``async_save``: DCP stages the tensors to CPU memory before this returns, then writes them
    from a background thread; the main rank commits (manifest, marker, rename, retention) only
    once that write has finished everywhere, so a crash meanwhile leaves the previous checkpoint
    the newest complete one. Returns a ``PendingSave``; wait for it before the next save."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if _is_main(group):
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        (partial / "rng").mkdir()
    _barrier(group)
    # The small files first: once any rank's DCP write has finished, every rank has passed here.
    torch.save(rng_state(device), partial / "rng" / f"rank{_rank(group)}.pt")
    if _is_main(group):
        (partial / EXTRA).write_text(json.dumps(extra, indent=1, sort_keys=True))
    if async_save:
        stager = _Stager()
        written = dcp.async_save(tensors, checkpoint_id=str(partial),
                                 process_group=_async_group(group), async_stager=stager)
        main = _is_main(group)

        def finish() -> None:
            try:
                written.result()
            finally:
                stager.close()
            # DCP's last step gathers every rank's write results to rank 0 before it writes
            # .metadata, so when rank 0's write is done, every rank's files are on disk.
            if main:
                _commit(root, partial, final, step, keep)

        runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-checkpoint")
        future = runner.submit(finish)
        runner.shutdown(wait=False)
        return PendingSave(final, future)
    dcp.save(tensors, checkpoint_id=str(partial), process_group=group)
    _barrier(group)  # every rank's files are on disk before the manifest is computed
    if _is_main(group):
        _commit(root, partial, final, step, keep)
    _barrier(group)
    return final


def _weights_only_load_planner() -> Any:
    """DCP's default load planner, except that non-tensor values (hyper-parameters such as
    ``lr`` and ``betas``) are unpickled with ``weights_only=True``: DCP's own ``load_bytes``
    uses ``weights_only=False``, which would run whatever a crafted checkpoint names."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(
                    f"refusing to load {read_item.dest_index.fqn}: a non-tensor value that is"
                    f" not plain data (it could execute code): {str(err).splitlines()[-1]}"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict,
                            self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyLoadPlanner()


def load(path: Path, tensors: dict[str, Any], *, device: torch.device = torch.device("cpu"),
         group: Any = None) -> dict[str, Any]:
    """Verify ``path`` (main rank), then load it into ``tensors`` in place (collective) and
    restore this rank's RNG state when the checkpoint has one for it. Returns ``extra``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    verdict = [None]
    if _is_main(group):
        try:
            verify(path)
        except CheckpointError as err:
            verdict = [str(err)]
    if dist.is_initialized():
        dist.broadcast_object_list(verdict, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    try:
        dcp.load(tensors, checkpoint_id=str(path), process_group=group,
                 planner=_weights_only_load_planner())
    except dcp.api.CheckpointException as err:  # DCP gathers every rank's failure
        # each failure is (exception, traceback summary)
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if refused:
            raise CheckpointError(f"{path}: {refused[0]}") from None
        raise
    rng_file = path / "rng" / f"rank{_rank(group)}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved
        set_rng_state(torch.load(rng_file, weights_only=True), device)
    return json.loads((path / EXTRA).read_text())


def latest_loadable(root: Path) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint that verifies, and why each newer one was refused."""
    refused: list[str] = []
    for candidate in reversed(complete_checkpoints(root)):
        try:
            verify(candidate)
            return candidate, refused
        except CheckpointError as err:
            refused.append(str(err))
    return None, refused
