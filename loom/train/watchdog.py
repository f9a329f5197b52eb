"""Which rank never arrived: per-rank progress records and a collective watchdog.

Every rank of a ``loom train`` job keeps one small JSON record, ``run_dir/.progress/rank<R>.json``:
its pid and host, the step it is on, and — while ``Trainer.fit`` runs — how many collectives it
has *entered* on each process group (and on each point-to-point pair), with a short history of
them (op, axis, tensor size, step, time), plus a heartbeat. ``CollectiveWatch`` fills it: inside
``fit`` it wraps the ``torch.distributed`` functions Loom's code calls (``dist.all_reduce``,
``dist.isend``, ``dist.all_gather_object``, ...; every call site looks them up on the module at
call time) and puts the originals back on exit, so nothing outside ``fit`` is touched. A call only
bumps in-memory counters; a background thread writes the record (at once when something changed,
else every heartbeat interval).

When a collective times out (``train.timeout_s``), the surviving ranks read every record and
``diagnose`` names the rank(s) the others are waiting for: a rank whose count on a group is
behind a waiting rank's never arrived at the collective with the next number (described from the
waiting rank's history); a rank at the same count whose heartbeat stopped (SIGSTOP, a kernel hang,
a node gone) stopped responding inside the one it entered. A rank that is itself waiting for
someone else is a victim, not a culprit (cascades through sub-groups name the root). The result
goes to ``run_dir/.progress/diagnosis-rank<R>.json`` and into the rank's exception
(``HungRankError``); the launcher (``loom.launch``) prints it, kills the hung process at once
instead of waiting 30 s for it to honour a SIGTERM it cannot see while stopped, and leaves out
torch's traceback. If the backend never raises, the watchdog thread does the same after
``timeout_s`` plus a margin and ends the process (a hang must fail the job, not freeze it).

Why hand-written: gloo's timeout says only "Timed out waiting 10000ms for recv operation to
complete" on the rank that waited; ``monitored_barrier`` names missing ranks but only at a
barrier, and torch's flight recorder / ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` are backend-specific
dumps or per-call consistency checks with extra round trips. Counting entries per group is a few
dictionary updates per call and works for any backend, host-local or shared file systems alike.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

PROGRESS_DIR = ".progress"
HISTORY = 16  # entries kept per group in a record (enough to describe what a rank missed)


class HungRankError(RuntimeError):
    """A collective timed out because the named rank(s) never arrived; the message says where."""


def progress_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PROGRESS_DIR


def rank_file(run_dir: str | Path, rank: int) -> Path:
    return progress_dir(run_dir) / f"rank{rank}.json"


def diagnosis_file(run_dir: str | Path, rank: int) -> Path:
    return progress_dir(run_dir) / f"diagnosis-rank{rank}.json"


def job_id() -> str:
    """This attempt of this job: records of an earlier job or restart in the same run directory
    are ignored by readers."""
    return (f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
            f"/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Atomically (readers never see half a record)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def clear(run_dir: str | Path) -> None:
    """Remove the records of earlier jobs (the launcher does this before starting workers)."""
    folder = progress_dir(run_dir)
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)


def register(run_dir: str | Path, rank: int) -> None:
    """First record of a worker (pid and host): the launcher forwards signals to registered pids."""
    progress_dir(run_dir).mkdir(parents=True, exist_ok=True)
    now = time.time()
    write_json(rank_file(run_dir, rank), {
        "rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "job": job_id(),
        "status": "starting", "step": 0, "counts": {}, "members": {}, "history": {},
        "heartbeat": now, "progress": now})


def _read(run_dir: str | Path, pattern: str, job: str | None) -> list[dict[str, Any]]:
    """The readable records of ``job`` (None: any job) in the files matching ``pattern``."""
    found = []
    folder = progress_dir(run_dir)
    for path in sorted(folder.glob(pattern)) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if job is None or record.get("job") == job:
            found.append(record)
    return found


def read_records(run_dir: str | Path, job: str | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's latest record of ``job`` (default: any job), by rank."""
    return {int(record["rank"]): record for record in _read(run_dir, "rank*.json", job)}


def read_diagnoses(run_dir: str | Path, job: str | None = None) -> list[dict[str, Any]]:
    return sorted(_read(run_dir, "diagnosis-rank*.json", job), key=lambda d: d["reporter"])


# -- the diagnosis ----------------------------------------------------------------------------


def _process_state(record: dict[str, Any]) -> str | None:
    """'stopped', 'exited', ... for a process on this host (None elsewhere or when unknown)."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        stat = Path(f"/proc/{record['pid']}/stat").read_text()
    except FileNotFoundError:
        return "exited"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited",
            "D": "in uninterruptible sleep"}.get(state)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 2 else f"{seconds:.1f} s"


def _entry(entry: list | None) -> str:
    """``[n, text, step, time]`` -> 'all_reduce (dp, 1 element) of step 3'."""
    if entry is None:
        return "a collective"
    return f"{entry[1]} of step {entry[2]}" if entry[2] else entry[1]


@dataclass
class Diagnosis:
    culprits: list[int]
    message: str
    reporter: int
    waited_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"culprits": self.culprits, "message": self.message, "reporter": self.reporter,
                "waited_s": self.waited_s, "job": job_id(), "time": time.time()}


def diagnose(records: dict[int, dict[str, Any]], reporter: int, *, now: float | None = None,
             stale_after: float = 3.0,
             state: Callable[[dict[str, Any]], str | None] = _process_state) -> Diagnosis | None:
    """Name the rank(s) the others wait for, from everyone's records (see the module docstring).

    None when nothing points at a culprit other than ``reporter`` (e.g. the reporter is the slow
    one, or the rank it waited for crashed: that rank's own error tells the story)."""
    now = time.time() if now is None else now
    running = {r for r, rec in records.items()
               if rec.get("status") in ("starting", "running") and state(rec) != "exited"}
    waits: dict[int, dict[int, tuple[str, list | None]]] = {}  # waiter -> culprit -> (key, entry)
    for waiter in running:
        rec = records[waiter]
        for key, count in rec.get("counts", {}).items():
            history = {e[0]: e for e in rec.get("history", {}).get(key, [])}
            for member in rec.get("members", {}).get(key, []):
                other = records.get(member)
                other_count = other.get("counts", {}).get(key, 0) if other else 0
                if member != waiter and other_count < count:
                    missed = history.get(other_count + 1)
                    old = waits.setdefault(waiter, {}).get(member)
                    if old is None or (missed and old[1] and missed[3] < old[1][3]):
                        waits[waiter][member] = (key, missed)

    def stale(rank: int) -> bool:
        rec = records.get(rank)
        return rec is None or now - rec.get("heartbeat", 0) > stale_after

    waited_on = {c for found in waits.values() for c in found}
    culprits = sorted(r for r in waited_on
                      if (r in running or r not in records) and (r not in waits or stale(r)))
    # A live rank the reporter waits for may itself be blocked in an op it has not recorded
    # yet (a point-to-point op to a frozen neighbour): a rank whose heartbeat has stopped
    # explains the wait better, and killing the live one too would lose two neighbouring
    # stages at once (CheckFree rebuilds one stage from its two neighbours).
    silent = sorted(r for r in running if stale(r) and r != reporter)
    culprits = [r for r in culprits if stale(r)] or silent or culprits
    if not culprits or reporter in culprits:
        return None
    lines = []
    for rank in culprits:
        rec = records.get(rank)
        waiter = reporter if rank in waits.get(reporter, {}) else next(
            (w for w in sorted(waits) if rank in waits[w]), None)
        last = rec.get("last") if rec else None
        if waiter is not None:
            line = f"rank {rank} never arrived at {_entry(waits[waiter][rank][1])}"
        else:  # it entered the collective the others wait in, then went silent
            line = f"rank {rank} stopped responding in {_entry(last)}"
        if rec is None:
            line += "; it never reported (did it start?)"
        else:
            line += f"; last seen {_ago(now - rec.get('heartbeat', now))} ago"
            if last and waiter is not None:
                line += f" at {_entry(last)}"
            elif not last and rec.get("step"):
                line += f" in step {rec['step']}"
            proc_state = state(rec)
            line += f" (pid {rec.get('pid')}{', ' + proc_state if proc_state else ''})"
        lines.append(line)
    waited = now - records[reporter].get("progress", now) if reporter in records else 0.0
    return Diagnosis(culprits, "; ".join(lines), reporter, waited)


# -- the watch --------------------------------------------------------------------------------

# name -> (index and keyword of the tensor argument, index of ``group``, peer: 'dst'/'src'/None)
_OPS: dict[str, tuple[int | None, str | None, int, str | None]] = {
    "all_reduce": (0, "tensor", 2, None),
    "broadcast": (0, "tensor", 2, None),
    "reduce": (0, "tensor", 3, None),
    "all_gather_into_tensor": (0, "output_tensor", 2, None),
    "reduce_scatter_tensor": (1, "input", 3, None),
    "reduce_scatter_single": (1, "input", 3, None),  # what loom.parallel.comm calls
    "all_to_all_single": (1, "input", 4, None),
    "all_gather": (1, "tensor", 2, None),
    "barrier": (None, None, 0, None),
    "all_gather_object": (None, None, 2, None),
    "broadcast_object_list": (None, None, 2, None),
    "gather_object": (None, None, 3, None),
    "scatter_object_list": (None, None, 3, None),
    "send": (0, "tensor", 2, "dst"), "isend": (0, "tensor", 2, "dst"),
    "recv": (0, "tensor", 2, "src"), "irecv": (0, "tensor", 2, "src"),
}


def _arg(args: tuple, kwargs: dict, index: int | None, name: str | None) -> Any:
    if name is not None and name in kwargs:
        return kwargs[name]
    if index is not None and index < len(args):
        return args[index]
    return None


def _size(tensor: Any) -> str:
    numel = getattr(tensor, "numel", None)
    if numel is None:
        return "objects"
    n = numel()
    return f"{n:,} element{'s' if n != 1 else ''}"


@dataclass
class _State:
    step: int = 0
    status: str = "running"
    counts: dict[str, int] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)
    history: dict[str, deque] = field(default_factory=dict)
    last: list | None = None
    progress: float = field(default_factory=time.time)


class CollectiveWatch:
    """Record every collective this rank enters (see the module docstring); a context manager.

    ``group_names`` maps process-group names to axis names ('dp', 'tp', ...) for the messages.
    Calls from other threads (an asynchronous checkpoint's writer, on a group of its own) pass
    through uncounted: counts must match across ranks, and only the training thread's do.
    """

    def __init__(self, run_dir: str | Path, rank: int, timeout_s: float,
                 group_names: dict[str, str] | None = None, *, heartbeat_s: float | None = None,
                 exit_on_hang: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.timeout_s = timeout_s
        self.group_names = dict(group_names or {})
        self.heartbeat_s = heartbeat_s or min(1.0, max(0.05, timeout_s / 10))
        self.stale_after = max(3 * self.heartbeat_s, 0.3)
        self.exit_on_hang = exit_on_hang
        self._state = _State()
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._originals: dict[str, Callable] = {}
        self._thread: threading.Thread | None = None
        self._owner = 0
        self._groups: dict[int, tuple[str, str, list[int]]] = {}
        self._identity = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                          "job": job_id()}
        self.diagnosis: Diagnosis | None = None

    # -- install / uninstall
    def __enter__(self) -> CollectiveWatch:
        import torch.distributed as dist

        progress_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        self._owner = threading.get_ident()
        for name in _OPS:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))
        self._write()
        self._thread = threading.Thread(target=self._run, name=f"loom-watchdog-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._state.status == "running":
            self._state.status = "failed" if exc_type is not None else "finished"
        self._write()

    def _wrap(self, name: str, original: Callable) -> Callable:
        tensor_index, tensor_name, group_index, peer = _OPS[name]

        def watched(*args, **kwargs):
            if threading.get_ident() == self._owner:
                self._enter(name, _arg(args, kwargs, group_index, "group"),
                            _arg(args, kwargs, tensor_index, tensor_name),
                            peer and (_arg(args, kwargs, 1, peer), peer))
            return original(*args, **kwargs)

        watched.__wrapped__ = original
        watched.__name__ = name
        return watched

    # -- recording
    def set_step(self, step: int) -> None:
        """The step being run (collectives are described as 'of step N'); counts as progress."""
        with self._lock:
            self._state.step = step
            self._state.progress = time.time()
        self._changed.set()

    def set_status(self, status: str) -> None:
        with self._lock:
            self._state.status = status
        self._changed.set()

    def _group(self, group: Any) -> tuple[str, str, list[int]]:
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        known = self._groups.get(id(pg))
        if known is None:
            key = str(getattr(pg, "group_name", id(pg)))
            ranks = dist.get_process_group_ranks(pg)
            if pg is dist.group.WORLD and key not in self.group_names:
                label = "world"
            else:
                label = self.group_names.get(key) or f"ranks {ranks[0]}-{ranks[-1]}"
            known = self._groups[id(pg)] = (key, label, ranks)
        return known

    def _enter(self, op: str, group: Any, tensor: Any, peer: tuple[Any, str] | None) -> None:
        import torch.distributed as dist

        key, label, ranks = self._group(group)
        what = _size(tensor) if tensor is not None or op.endswith("object") \
            or op.endswith("object_list") else ""
        if peer is not None:
            other, direction = peer
            other = -1 if other is None else int(other)
            me = dist.get_rank()
            src, dst = (me, other) if direction == "dst" else (other, me)
            key, ranks = f"{key}:{src}>{dst}", [src, dst] if other >= 0 else [me]
            op = f"{op} {'to' if direction == 'dst' else 'from'} rank {other}"
        text = f"{op} ({label}{', ' + what if what else ''})"
        now = time.time()
        with self._lock:
            state = self._state
            n = state.counts.get(key, 0) + 1
            state.counts[key] = n
            state.members.setdefault(key, ranks)
            entry = [n, text, state.step, now]
            state.history.setdefault(key, deque(maxlen=HISTORY)).append(entry)
            state.last = entry
            state.progress = now
        self._changed.set()

    # -- records
    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = self._state
            return {**self._identity, "status": s.status, "step": s.step, "counts": dict(s.counts),
                    "members": dict(s.members),
                    "history": {k: list(v) for k, v in s.history.items()}, "last": s.last,
                    "progress": s.progress, "heartbeat": time.time()}

    def _write(self) -> None:
        try:
            write_json(rank_file(self.run_dir, self.rank), self._snapshot())
        except OSError:
            pass  # a full or vanished disk must not fail training; the record just goes stale

    def stalled_for(self) -> float:
        """Seconds since this rank last entered a collective or started a step."""
        return time.time() - self._state.progress

    def check(self) -> Diagnosis | None:
        """Diagnose from everyone's records now; write and return the diagnosis if one is found."""
        self._write()
        found = diagnose(read_records(self.run_dir, job_id()), self.rank,
                         stale_after=self.stale_after)
        if found is not None:
            self.diagnosis = found
            try:
                write_json(diagnosis_file(self.run_dir, self.rank), found.as_dict())
            except OSError:
                pass
        return found

    def hung_error(self, err: BaseException) -> HungRankError | None:
        """For an exception out of the training loop: a ``HungRankError`` naming the rank(s) this
        rank waited for, when it had been waiting long enough for a timeout (else None: a peer
        that crashed or an error of this rank's own is not a hang)."""
        if isinstance(err, HungRankError):
            return None
        if self.stalled_for() < 0.5 * self.timeout_s:
            # A quick failure is a crashed peer or this rank's own error, unless a peer's
            # heartbeat stopped long ago (the timeout then counted from an earlier entry).
            records = read_records(self.run_dir, job_id())
            if not any(time.time() - rec.get("heartbeat", 0) > max(self.stale_after, 0.5 *
                       self.timeout_s) for r, rec in records.items() if r != self.rank):
                return None
        found = self.diagnosis or self.check()
        if found is None:
            return None
        return HungRankError(f"{found.message} (rank {self.rank} waited"
                             f" {_ago(max(found.waited_s, 0.0))}; train.timeout_s ="
                             f" {self.timeout_s:g})")

    def _run(self) -> None:
        margin = max(5.0, 0.1 * self.timeout_s)
        while not self._stop.is_set():
            self._changed.wait(self.heartbeat_s)
            self._changed.clear()
            if self._stop.is_set():
                break
            self._write()
            if self.exit_on_hang and self.stalled_for() > self.timeout_s + margin \
                    and self._state.status == "running":
                found = self.diagnosis or self.check()
                if found is not None:  # the backend never raised: fail the job, do not hang it
                    self.set_status("failed")
                    self._write()
                    print(f"loom: rank {self.rank}: collective timed out: {found.message}",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            self._stop.wait(0.01)  # at most ~100 writes a second however busy the step is
