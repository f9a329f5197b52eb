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

Loading refuses what it cannot trust (``loom.train.checkpoint_safety`` holds the rules): a
missing, truncated or altered file (the manifest's size and SHA-256 do not match; with
``LOOM_CHECKPOINT_KEY`` set, a manifest whose HMAC does not match or that has none), a symbolic
link or a path that leaves the checkpoint, and anything that would execute code when unpickled.
DCP's ``.metadata`` pickle is read, by ``verify`` and by DCP itself (through Loom's storage
reader), with an exact-name allow-list of DCP's metadata classes; tensors, DCP's non-tensor
values (hyper-parameters such as ``lr`` and ``betas``, which DCP itself would unpickle with
``weights_only=False``) and RNG files with ``torch.load(weights_only=True)``; ``extra.json`` is
JSON. ``latest_loadable`` skips, and names, every newer checkpoint that fails any of these, so a
resume falls back to the newest one that is complete and valid. This module is Loom's own
because DCP leaves commit markers, checksums, retention and safe metadata to the caller.

Saving reports a failure in one line on every rank (a full disk, a read-only or vanished folder):
the path, the reason, and the bytes this rank needed against those free; the ``.partial`` folder
is removed and the previous checkpoint is untouched. Every rank learns of a failure on any rank
(one small all-gather per phase), so none is left waiting at the next barrier.

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

import io
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from loom.train.checkpoint_safety import (CheckpointError, check_signature, load_metadata,
                                          load_rng_file, read_manifest, regular_files,
                                          safe_storage_reader, sha256_of, sign)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
EXTRA = "extra.json"
_PREFIX = "step_"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def _is_step_number(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts "²", which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and _is_step_number(p.name[len(_PREFIX):])
             and (p / COMMIT_MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def _files(directory: Path) -> list[str]:
    """The checkpoint's files the manifest covers (all but the manifest and the marker)."""
    return regular_files(directory, skip=(MANIFEST, COMMIT_MARKER))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Verification


def read_extra(path: Path) -> Any:
    """``extra.json``'s JSON; CheckpointError when it is not a readable regular file of JSON."""
    if not (path / EXTRA).is_file():  # a FIFO would block the read
        raise CheckpointError(f"{path / EXTRA}: missing or not a regular file")
    try:
        return json.loads((path / EXTRA).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: absurdly deep JSON
        raise CheckpointError(f"{path / EXTRA}: unreadable ({type(err).__name__}:"
                              f" {str(err)[:200]})") from None


MAX_STEP = 2**62  # steps and sample counts: far beyond any run, and int64 arithmetic holds


def _check_extra(path: Path, step: Any) -> None:
    """extra.json names an integer step in [0, MAX_STEP), the manifest's and, for a folder
    named ``step_<N>``, N (a re-hashed edit of the step would otherwise resume elsewhere)."""
    extra = read_extra(path)
    if not isinstance(extra, dict) or type(extra.get("step")) is not int \
            or not 0 <= extra["step"] < MAX_STEP:
        raise CheckpointError(f"{path / EXTRA}: malformed (no integer step in [0, 2^62))")
    if type(step) is int and extra["step"] != step:
        raise CheckpointError(f"{path / EXTRA}: says step {extra['step']}, the manifest {step}")
    named = path.name[len(_PREFIX):] if path.name.startswith(_PREFIX) else ""
    if _is_step_number(named) and int(named) != extra["step"]:
        raise CheckpointError(f"{path / EXTRA}: says step {extra['step']}, the folder's name"
                              f" {int(named)}")


def verify(path: Path) -> dict[str, Any]:
    """Check the commit marker, the manifest (shape, signature when ``LOOM_CHECKPOINT_KEY`` is
    set), every file's size and SHA-256, that nothing is a symbolic link or unlisted, and that
    the metadata, RNG files and ``extra.json`` load safely.

    Returns the manifest; raises CheckpointError naming the first bad file.
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder (missing, a file or a link)")
    if not (path / COMMIT_MARKER).is_file():
        raise CheckpointError(f"{path}: incomplete (no {COMMIT_MARKER} marker)")
    manifest = read_manifest(path / MANIFEST)  # refuses a link or a non-regular file
    check_signature(manifest, path / MANIFEST)
    present = _files(path)  # refuses symbolic links anywhere in the folder
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file}: truncated or altered ({size} bytes, expected"
                                  f" {entry['size']})")
        if sha256_of(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: corrupted (SHA-256 does not match the manifest)")
    extra_files = set(present) - set(manifest["files"])
    if extra_files:
        raise CheckpointError(f"{path}: files not in the manifest: {sorted(extra_files)}")
    load_metadata(path)  # unpickled with the exact allow-list; plain files of path only
    _check_extra(path, manifest.get("step"))
    for name in present:
        if name.startswith("rng/"):
            load_rng_file(path / name)
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


def sharded_tensor_to_cpu(value: Any) -> Any:
    """A CPU copy of a ShardedTensor built here (the staging of an asynchronous save; DCP's own
    stager copies plain tensors and DTensors but not ShardedTensors)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    def on_cpu(md: Any) -> Any:
        return ShardMetadata(md.shard_offsets, md.shard_sizes, f"rank:{md.placement.rank()}/cpu")

    meta = value.metadata()
    shards_md = [on_cpu(md) for md in meta.shards_metadata]
    local = [Shard(s.tensor.detach().to("cpu", copy=True), on_cpu(s.metadata))
             for s in value.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(shards_md, meta.size, meta.tensor_properties),
        sharding_spec=EnumerableShardingSpec(shards_md))


def is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


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
    """Main rank, after every rank's files are on disk: manifest (signed when a key is set),
    marker, rename, retention. Retention only ever removes committed checkpoints, never one
    still being written."""
    files = {name: {"size": (partial / name).stat().st_size, "sha256": sha256_of(partial / name)}
             for name in _files(partial)}
    manifest = sign({"step": step, "files": files})
    _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1))
    _write_atomic(partial / COMMIT_MARKER, json.dumps({"step": step, "time": time.time()}))
    if final.exists():  # an older save of the same step (e.g. after a restart)
        shutil.rmtree(final)
    os.replace(partial, final)
    if keep > 0:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


_MiB = 1 << 20


def _local_bytes(tree: Any) -> int:
    """Bytes of the tensors this rank writes (local shards of sharded and distributed ones)."""
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    local = getattr(tree, "_local_tensor", None)
    if local is not None:
        tree = local
    shards = getattr(tree, "local_shards", None)
    if callable(shards):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in shards())
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return 0


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _size(n: int) -> str:
    return f"{n / _MiB:.1f} MiB" if n >= _MiB else f"{n / 1024:.1f} KiB"


def _describe_write_error(err: BaseException, partial: Path, step: int, needed: int) -> str:
    """One line: where the save failed, why, and the bytes it needed against those free. torch's
    zip writer reports a full disk as ``unexpected pos A vs B``; OSError carries errno."""
    if isinstance(err, OSError) and err.strerror:
        reason = f"{err.strerror} ({err.filename or partial})"
    else:
        text = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {text[-1] if text else ''}".strip()
        if "unexpected pos" in reason or "file write failed" in reason:
            reason = f"a write was cut short ({reason}); the disk is probably full"
    free = _free_bytes(partial)
    space = (f"; this rank needs about {_size(needed)}, {_size(free)} free on that filesystem"
             if free is not None else "")
    return (f"cannot save checkpoint step {step} to {partial}: {reason}{space}; the previous"
            " checkpoint is left intact")


def _agree(group: Any, error: str | None) -> None:
    """Every rank learns whether any rank failed its part (a collective); all raise the first
    failure's message, so no rank waits forever at the save's next barrier."""
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, error, group=group)
        failed = [(rank, msg) for rank, msg in enumerate(every) if msg is not None]
        if failed and error is None:
            rank, msg = failed[0]
            error = f"rank {rank}: {msg}"
    if error is not None:
        raise CheckpointError(error)


def _failures() -> tuple[type[BaseException], ...]:
    """What a DCP write or read may raise: its CheckpointException derives from BaseException,
    not Exception. Imported on use: DCP's package imports DTensor (about 1.5 s), which
    ``loom train``'s resume check (``resume_refusal``, before any worker starts) never needs."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _unwrap_dcp_failure(err: BaseException) -> BaseException:
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (exc, tb)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return err


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
    main = _is_main(group)
    needed = _local_bytes(tensors)

    def attempt(action: Any) -> str | None:
        try:
            action()
            return None
        except _failures() as err:  # every failure becomes one named line
            return _describe_write_error(_unwrap_dcp_failure(err), partial, step, needed)

    def cleanup() -> None:
        if main:
            shutil.rmtree(partial, ignore_errors=True)

    def prepare() -> None:
        if main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            (partial / "rng").mkdir()

    def small_files() -> None:
        # The small files first: once any rank's DCP write has finished, every rank is past here.
        torch.save(rng_state(device), partial / "rng" / f"rank{_rank(group)}.pt")
        if main:
            (partial / EXTRA).write_text(json.dumps(extra, indent=1, sort_keys=True))

    try:
        _agree(group, attempt(prepare))
        _agree(group, attempt(small_files))
    except CheckpointError:
        cleanup()
        raise
    if async_save:
        stager = _Stager()
        written = dcp.async_save(tensors, checkpoint_id=str(partial),
                                 process_group=_async_group(group), async_stager=stager)

        def finish() -> None:
            try:
                written.result()
            except _failures() as err:
                cleanup()
                raise CheckpointError(_describe_write_error(_unwrap_dcp_failure(err), partial,
                                                            step, needed)) from None
            finally:
                stager.close()
            # DCP's last step gathers every rank's write results to rank 0 before it writes
            # .metadata, so when rank 0's write is done, every rank's files are on disk.
            if main:
                error = attempt(lambda: _commit(root, partial, final, step, keep))
                if error is not None:
                    cleanup()
                    raise CheckpointError(error)

        runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-checkpoint")
        future = runner.submit(finish)
        runner.shutdown(wait=False)
        return PendingSave(final, future)
    try:
        # DCP gathers every rank's write outcome, so a failure anywhere raises everywhere.
        error = attempt(lambda: dcp.save(tensors, checkpoint_id=str(partial), process_group=group))
        if error is not None:
            raise CheckpointError(error)
        _barrier(group)  # every rank's files are on disk before the manifest is computed
        _agree(group, attempt(lambda: _commit(root, partial, final, step, keep)) if main else None)
    except CheckpointError:
        cleanup()
        raise
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
            except Exception as err:  # UnpicklingError for a refused global; any for garbage
                last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                raise CheckpointError(
                    f"refusing to load {read_item.dest_index.fqn}: a non-tensor value that is"
                    f" not plain data (it could execute code): {last}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict,
                            self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyLoadPlanner()


def load(path: Path, tensors: dict[str, Any], *, device: torch.device = torch.device("cpu"),
         group: Any = None, verified: bool = False) -> dict[str, Any]:
    """Verify ``path`` (main rank; ``verified``: the caller just did, as ``latest_loadable``
    does, so its files are not hashed twice), then load it into ``tensors`` in place
    (collective) and restore this rank's RNG state when the checkpoint has one for it. Returns
    ``extra``. Whatever was verified, everything is read safely (metadata through the allow-list,
    the rest with ``weights_only``)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    verdict = [None]
    if _is_main(group) and not verified:
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
        dcp.load(tensors, storage_reader=safe_storage_reader(path), process_group=group,
                 planner=_weights_only_load_planner())
    except CheckpointError as err:  # raised before DCP's collectives (reading .metadata)
        raise CheckpointError(f"{path}: {err}") from None
    except _failures() as err:  # DCP gathers every rank's failure: rank -> (exception, traceback)
        cause = _unwrap_dcp_failure(err)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(f"{path}: {cause}") from None
        last = (str(cause).strip().splitlines() or [""])[-1]
        raise CheckpointError(f"{path}: does not load into this model and layout"
                              f" ({type(cause).__name__}: {last})") from None
    rng_file = path / "rng" / f"rank{_rank(group)}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved
        set_rng_state(load_rng_file(rng_file), device)
    return read_extra(path)


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


def resume_refusal(spec: str, root: Path,
                   check: Callable[[Path], str | None] | None = None) -> str | None:
    """Why ``checkpoint.resume = spec`` cannot start (checked before any process starts), or
    None. ``auto`` needs a complete and valid checkpoint under ``root`` (the run's
    ``checkpoints`` folder); ``auto_or_fresh`` never refuses; a directory must verify. The
    checkpoint found must then pass ``check`` (the caller's: the model it builds)."""
    if spec == "":
        return None
    if spec in ("auto", "auto_or_fresh"):
        found, refused = latest_loadable(root)
        if found is None and spec == "auto_or_fresh":
            return None
        if found is None:
            skipped = f"; skipped: {' | '.join(refused)}" if refused else ""
            return (f"checkpoint.resume=auto: no complete and valid checkpoint under {root}"
                    f"{skipped}; pass --resume auto_or_fresh to start from step 0 instead")
    else:
        found = Path(spec)
        try:
            verify(found)
        except CheckpointError as err:
            return f"checkpoint.resume={spec}: {err}"
    refusal = check(found) if check is not None else None
    return f"checkpoint.resume={spec}: {refusal}" if refusal else None
