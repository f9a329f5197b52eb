"""Shared machinery of the fuzz suite (``tests/fuzz``) and of ``bench/fuzz.py``.

Every fuzz target returns an ``Outcome``: ``ok`` (exit 0 / the call succeeded), ``refused`` (exit
2 with one line / the project's own error type: ``ConfigError``, ``CheckpointError``) or
``other`` (a traceback, another exit code, a file written on a refusal, a file changed outside the
run directory, a checkpoint that loaded different content, code that ran). The tests fail on
``other``; the benchmark counts each kind per category.

Known bugs (``KNOWN_BUGS``) are ``other`` outcomes whose owner is routing a fix: the fuzz tests
tolerate them (unless ``LOOM_FUZZ_STRICT=1``) so that they keep looking for *new* ones, and each
has an exact reproduction marked ``xfail(strict=False)`` in ``test_fuzz_regressions.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, settings

# ---------------------------------------------------------------------------------------------
# Profiles and budgets

_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
           HealthCheck.large_base_example]
# ci: bounded and reproducible (the same examples every run, nothing written into the repo).
# bench: fresh random examples each run, many more of them (bench/fuzz.py).
PROFILES = {
    "ci": dict(deadline=None, database=None, derandomize=True, print_blob=True,
               suppress_health_check=_HEALTH, max_examples=50),
    "bench": dict(deadline=None, database=None, derandomize=False, print_blob=True,
                  suppress_health_check=_HEALTH, max_examples=200),
}
# Examples per fuzz test and profile. ci: the whole folder in ~1.5 minutes on 2 cores (the
# suite's 25-minute budget; the bench profile runs 2.5-4x as many, fresh each time).
BUDGETS = {
    "ci": {"config_fast": 300, "config_fast_typed": 150, "config_cli": 80, "config_train": 2,
           "toml_bytes": 80, "toml_mutated": 80, "data": 80, "checkpoint": 150,
           "checkpoint_pickle": 60, "plan_layout": 120, "plan_mixed": 60},
    "bench": {"config_fast": 1500, "config_fast_typed": 500, "config_cli": 400, "config_train": 6,
              "toml_bytes": 300, "toml_mutated": 300, "data": 300, "checkpoint": 800,
              "checkpoint_pickle": 200, "plan_layout": 1000, "plan_mixed": 400},
}
_ACTIVE = {"profile": "ci"}


def use_profile(name: str) -> None:
    """Register both profiles and make ``name`` the default (and the one ``budget`` reads).

    Hypothesis keeps caches (and, on a failure, a patch file) in ``.hypothesis`` of the working
    directory: here they go to the system's temporary directory, never into the repository."""
    from hypothesis.configuration import set_hypothesis_home_dir

    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "loom-fuzz-hypothesis")
    for profile, kwargs in PROFILES.items():
        settings.register_profile(profile, **kwargs)
    if name not in PROFILES:
        raise ValueError(f"unknown fuzz profile {name!r}; known: {', '.join(PROFILES)}")
    settings.load_profile(name)
    _ACTIVE["profile"] = name


def budget(key: str) -> int:
    return BUDGETS[_ACTIVE["profile"]][key]


def fuzz_settings(key: str) -> settings:
    """``@fuzz_settings("checkpoint")``: the active profile with this test's example budget."""
    return settings(settings.get_profile(_ACTIVE["profile"]), max_examples=budget(key))


# ---------------------------------------------------------------------------------------------
# Outcomes, known bugs and the recorder

STRICT = os.environ.get("LOOM_FUZZ_STRICT", "") not in ("", "0")


@dataclass
class Outcome:
    kind: str  # "ok" | "refused" | "other"
    detail: str = ""  # the error line, or what broke the property
    trace: str = ""  # the traceback, when there was one
    known_bug: str | None = None  # id in KNOWN_BUGS when this "other" is a known one

    @property
    def last_line(self) -> str:
        lines = [line for line in (self.trace or self.detail).strip().splitlines() if line.strip()]
        return lines[-1] if lines else ""


@dataclass(frozen=True)
class KnownBug:
    id: str
    owner: str  # whose area the fix is in
    summary: str
    pattern: str  # regex searched in "<category>: <detail>\n<trace>"


# Found by this suite; routed by the lead. Each has an xfail(strict=False) regression case in
# tests/fuzz/test_fuzz_regressions.py (which XPASSes once fixed: then delete the entry here).
KNOWN_BUGS: list[KnownBug] = []  # all seven found so far are fixed (test_fuzz_regressions.py)


def _match_known(category: str, outcome: Outcome) -> str | None:
    text = f"{category}: {outcome.detail}\n{outcome.trace}"
    for bug in KNOWN_BUGS:
        if re.search(bug.pattern, text, re.S):
            return bug.id
    return None


@dataclass
class Tally:
    tried: int = 0
    kinds: Counter = field(default_factory=Counter)
    examples: list[tuple[str, str, str]] = field(default_factory=list)  # (input, last line, bug)


class Recorder:
    """Per category: how many examples, of which kind; the inputs of the ``other`` ones."""

    def __init__(self) -> None:
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.raise_on_other = True

    def record(self, category: str, outcome: Outcome, example: Any) -> None:
        if outcome.kind == "other" and outcome.known_bug is None:
            outcome.known_bug = _match_known(category, outcome)
        tally = self.tallies[category]
        tally.tried += 1
        kind = outcome.kind if outcome.kind != "other" or not outcome.known_bug else "known-bug"
        tally.kinds[kind] += 1
        entry = (_short(repr(example), 600), outcome.last_line, outcome.known_bug or "")
        if outcome.kind == "other" and len(tally.examples) < 20 and entry not in tally.examples:
            tally.examples.append(entry)
        if self.raise_on_other and outcome.kind == "other" and (STRICT or not outcome.known_bug):
            raise AssertionError(f"{category}: {outcome.detail}\n"
                                 f"input: {_short(repr(example), 2000)}\n{outcome.trace}")


RECORDER = Recorder()


def check(category: str, outcome: Outcome, example: Any) -> Outcome:
    """Record the outcome; in tests, fail on ``other`` (known bugs tolerated unless strict)."""
    RECORDER.record(category, outcome, example)
    return outcome


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text)} chars)"


def from_exception(err: BaseException, where: str = "") -> Outcome:
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return Outcome("other", f"{where}{type(err).__name__}: {_short(str(err), 500)}", trace)


# ---------------------------------------------------------------------------------------------
# File trees: snapshots and workspaces


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (not following links, never opening FIFOs or devices):
    relative path -> (type, size, mtime_ns, sha256 of regular files up to 4 MiB)."""
    root = Path(root)
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            try:
                info = path.lstat()
            except OSError:
                continue
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(info.st_mode):
                digest = ""
                if info.st_size <= 4 << 20:
                    try:
                        digest = hashlib.sha256(path.read_bytes()).hexdigest()
                    except OSError:
                        digest = "unreadable"
                out[rel] = ("file", info.st_size, info.st_mtime_ns, digest)
            else:
                out[rel] = ("special", stat.S_IFMT(info.st_mode))
    return out


def changed_paths(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    keys = set(before) | set(after)
    return sorted(k for k in keys if before.get(k) != after.get(k))


_LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


@contextlib.contextmanager
def workspace(prefix: str = "loom-fuzz-") -> Iterator[Path]:
    """A fresh temporary directory as the working directory, with no launcher variables (so
    ``loom train`` launches its own workers), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    old_cwd = os.getcwd()
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_VARS if k in os.environ}
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(old_cwd)
        os.environ.update(saved)
        _rmtree(root)


@contextlib.contextmanager
def chdir(root: Path) -> Iterator[Path]:
    old = os.getcwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(old)


def _rmtree(root: Path) -> None:
    def onerror(func: Callable, path: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
            func(path)

    shutil.rmtree(root, onerror=onerror)


_SESSION: dict[str, Any] = {}


def session_dir() -> Path:
    """One temporary directory per process for what is made once (corpus, checkpoints)."""
    if "dir" not in _SESSION:
        import atexit

        path = Path(tempfile.mkdtemp(prefix="loom-fuzz-session-")).resolve()
        atexit.register(_rmtree, path)
        _SESSION["dir"] = path
    return _SESSION["dir"]


def once(key: str, make: Callable[[], Any]) -> Any:
    if key not in _SESSION:
        _SESSION[key] = make()
    return _SESSION[key]


# ---------------------------------------------------------------------------------------------
# Fixture files a workspace gets: a small corpus, odd sources, checkpoint-like directories

CORPUS_TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


def populate(root: Path) -> None:
    """Names the config strategies refer to: ``corpus.txt``, ``corpus/``, ``empty.txt``,
    ``binary.bin``, ``fifo``, ``ckpt`` (a committed-looking directory), ``ckpt_nomanifest``,
    ``ckpt_deep`` (a deeply nested manifest), ``ckpt_fifo`` (a FIFO as its manifest)."""
    (root / "corpus.txt").write_text(CORPUS_TEXT)
    (root / "corpus").mkdir()
    (root / "corpus" / "a.py").write_text(CORPUS_TEXT[: len(CORPUS_TEXT) // 2])
    (root / "corpus" / "b.txt").write_text(CORPUS_TEXT[len(CORPUS_TEXT) // 2:])
    (root / "empty.txt").write_bytes(b"")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    os.mkfifo(root / "fifo")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "COMMITTED").write_text("{}")
    (ckpt / "manifest.json").write_text('{"step": 1, "files": {}}')
    (root / "ckpt_nomanifest").mkdir()
    (root / "ckpt_nomanifest" / "COMMITTED").write_text("{}")
    (root / "ckpt_deep").mkdir()
    (root / "ckpt_deep" / "COMMITTED").write_text("{}")
    (root / "ckpt_deep" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "ckpt_fifo").mkdir()
    (root / "ckpt_fifo" / "COMMITTED").write_text("{}")
    os.mkfifo(root / "ckpt_fifo" / "manifest.json")


# ---------------------------------------------------------------------------------------------
# Running loom in-process


class LaunchStub:
    """Stands in for ``loom.launch.launch_local`` (the worker processes): everything before the
    launch runs for real (validation, run directory, token files), no worker starts."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Path, int]] = []

    def __call__(self, config: Any, run_dir: Path, nproc: int, *args: Any, **kwargs: Any) -> dict:
        self.calls.append((config, Path(run_dir), nproc))
        return {}

    @contextlib.contextmanager
    def installed(self) -> Iterator["LaunchStub"]:
        import loom.launch

        if not hasattr(loom.launch, "launch_local"):  # renamed: launch for real is too slow here
            raise RuntimeError("loom.launch.launch_local is gone; update tests/fuzz/harness.py")
        saved = loom.launch.launch_local
        loom.launch.launch_local = self
        try:
            yield self
        finally:
            loom.launch.launch_local = saved


def _under(path: str, prefix: str) -> bool:
    return prefix in ("", ".") or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def run_cli(argv: list[str], root: Path, *, launch: bool = False, command: str = "train"
            ) -> Outcome:
    """``loom.cli.main([command, *argv])`` in-process in workspace ``root``; judge the result.

    exit 2: stderr must be one line ``loom <command>: ...`` and nothing under ``root`` may change.
    exit 0: nothing outside the run directory (and its new parents) may change.
    ``launch=False`` replaces the worker launch by ``LaunchStub``."""
    from loom import cli

    before = snapshot(root)
    err, out = io.StringIO(), io.StringIO()
    stub = LaunchStub()
    rc: Any
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            with (contextlib.nullcontext() if launch else stub.installed()):
                rc = cli.main([command, *argv])
        except SystemExit as exc:  # argparse: usage errors exit 2 with one line
            rc = exc.code if isinstance(exc.code, int) else 1
            if rc == 2:
                return _judge_refusal(root, before, err.getvalue(), command, usage=True)
        except Exception as exc:  # noqa: BLE001 - the point: nothing but exit 0 or 2
            outcome = from_exception(exc)
            written = changed_paths(before, snapshot(root))
            if written:
                outcome.detail += f" (after writing {written[:5]})"
            return outcome
    if rc == 2:
        return _judge_refusal(root, before, err.getvalue(), command)
    if rc == 0:
        after = snapshot(root)
        if launch:
            allowed = [_rel(root, _config_run_dir(argv))] if _config_run_dir(argv) else ["runs"]
        else:
            if not stub.calls:
                return Outcome("other", "exit 0 but no worker launch was reached")
            allowed = [_rel(root, stub.calls[0][1])]
        parents = {str(Path(a).parents[i]) for a in allowed for i in range(len(Path(a).parts) - 1)}
        outside = [p for p in changed_paths(before, after)
                   if not any(_under(p, a) for a in allowed) and p not in parents]
        if outside:
            return Outcome("other", f"exit 0 but changed files outside the run directory"
                                    f" {allowed}: {outside[:8]}")
        return Outcome("ok")
    return Outcome("other", f"exit code {rc!r}; stderr: {_short(err.getvalue().strip(), 1500)}")


def _rel(root: Path, run_dir: Path | str) -> str:
    path = Path(os.path.abspath(run_dir))
    try:
        return str(path.relative_to(root))
    except ValueError:
        return f"<outside the workspace: {path}>"


def _config_run_dir(argv: list[str]) -> str | None:
    for arg in reversed(argv):
        if arg.startswith("--train.run_dir="):
            return arg.split("=", 1)[1] or None
    return None


def _judge_refusal(root: Path, before: dict, stderr: str, command: str, usage: bool = False
                   ) -> Outcome:
    written = changed_paths(before, snapshot(root))
    if written:
        return Outcome("other", f"refused (exit 2) but wrote or changed: {written[:8]}",
                       stderr[-2000:])
    lines = [line for line in stderr.strip().split("\n") if line.strip()]  # only \n breaks
    if usage:  # argparse's own refusal (``loom.errors.OneLineParser``): one error line
        if len(lines) != 1 or "error:" not in lines[0]:
            return Outcome("other", f"argparse exit 2 without one error line: {stderr[-500:]!r}")
        return Outcome("refused", lines[0])
    if len(lines) > 1 and stderr.startswith(f"loom {command}: ") \
            and stderr.count(f"loom {command}: ") == 1 and "Traceback" not in stderr:
        return Outcome("other", f"exit 2 with one message whose text holds a line break:"
                                f" {_short(stderr, 500)!r}")
    if len(lines) != 1 or not lines[0].startswith(f"loom {command}: "):
        return Outcome("other", f"exit 2 but stderr is not one 'loom {command}: ...' line:"
                                f" {_short(stderr, 1500)!r}")
    if "Traceback" in stderr:
        return Outcome("other", "exit 2 with a traceback", stderr)
    return Outcome("refused", lines[0])


_PATH_KEYS = ("data.source", "checkpoint.resume", "train.run_dir")


def contain_paths(overrides: dict[str, Any]) -> dict[str, Any]:
    """Keep path values inside the workspace: an absolute path, ``..`` or ``~`` could make a run
    walk (data.source = "/") or write (train.run_dir) outside it. Relative odd names stay."""
    out = dict(overrides)
    for key in _PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value not in ("", "stdlib", "auto"):
            safe = value
            if safe.lstrip().startswith(("/", "~")) and safe != "/nonexistent/corpus":
                safe = "./" + safe.lstrip().lstrip("/~")
            if ".." in Path(safe).parts or safe.strip() in (".", "./"):
                safe = safe.replace("..", "__").replace(".", "_") or "missing"
            out[key] = safe
    return out


def config_fast(overrides: dict[str, Any], world_size: int, path: str | None = None) -> Outcome:
    """``load_config`` + ``resolve`` (+ the memory check the CLI runs before writing): a Config,
    or ``ConfigError``; nothing else."""
    from loom.config import ConfigError, load_config, resolve

    overrides = contain_paths(overrides)
    try:
        config = resolve(load_config(path, overrides), world_size)
        from loom.train.memory import check_memory_limit

        refusal = check_memory_limit(config)
    except ConfigError as err:
        return Outcome("refused", str(err)[:300])
    except Exception as exc:  # noqa: BLE001
        return from_exception(exc)
    return Outcome("refused" if refusal else "ok", refusal or "")


def call_with_timeout(fn: Callable[[], Any], seconds: float, on_timeout: Callable[[], None]
                      ) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn`` in a thread; after ``seconds`` call ``on_timeout`` (which should unblock it,
    e.g. by opening a FIFO it waits on; called repeatedly) and report the hang.
    Returns (finished, value, error)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        deadline = time.monotonic() + 30
        while thread.is_alive() and time.monotonic() < deadline:
            on_timeout()  # again: the code may open the FIFO once per call
            thread.join(0.05)
        return False, None, None
    return True, box.get("value"), box.get("error")


def unblock_fifos(root: Path) -> None:
    """Open every FIFO under ``root`` for writing and close it: a reader blocked on it gets EOF."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                    os.close(fd)


def summary_table(recorder: Recorder = RECORDER) -> str:
    lines = [f"{'category':<22} {'tried':>6} {'exit 0':>7} {'exit 2':>7} {'known':>6} {'other':>6}"]
    for category, tally in sorted(recorder.tallies.items()):
        k = tally.kinds
        lines.append(f"{category:<22} {tally.tried:>6} {k['ok']:>7} {k['refused']:>7}"
                     f" {k['known-bug']:>6} {k['other']:>6}")
    return "\n".join(lines)

