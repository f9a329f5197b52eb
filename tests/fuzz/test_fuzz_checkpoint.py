"""Fuzzing checkpoint loading: mutated copies of small real checkpoints.

Each example copies the session's checkpoints (two steps, saved with
``loom.train.checkpoint.save`` in this process) into a fresh workspace, applies 1-4 mutations to
the newest (sometimes the older) step -- truncation, bit flips, appended or replaced bytes,
deleted files and folders, extra files, swapped files (within a step and across steps), edited
and forged manifests (sizes and hashes recomputed, as an attacker who can write the folder would),
rewritten ``.metadata`` / RNG / ``extra.json`` (pickles that would run ``os.mkdir(marker)``,
crafted DCP storage records, deep JSON), symlinks, FIFOs, folders in place of files, renamed
step folders -- then calls ``verify(step)``, ``latest_loadable(root)`` and ``load(step, template)``
(and ``load`` of what ``latest_loadable`` chose).

Property: each call returns or raises ``CheckpointError``; never another exception, never a hang;
no call writes anything; the marker never appears (no code ran); a load that succeeds returns the
exact original content unless the manifest was forged (then no integrity claim can hold), and
with ``LOOM_CHECKPOINT_KEY`` (the ``signed`` checkpoints) even a forged one may not load other
content.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import ckpt_mutations as M
from tests.fuzz import harness
from tests.fuzz.harness import Outcome, check, fuzz_settings, workspace

OPS = ["truncate", "flip", "overwrite", "append", "delete", "delete-rng-dir", "extra-file",
       "swap", "swap-across-steps", "manifest", "manifest", "forge", "forge", "metadata",
       "rng", "extra", "symlink", "fifo", "dir-for-file", "marker", "rename-step", "noop",
       "template"]
PICKLE_OPS = ["metadata", "metadata", "rng", "rng", "forge", "noop", "template"]
HANG_SECONDS = 5  # a normal example takes well under a second
ODD_NAMES = ["../outside.txt", "/etc/hostname", "a/../b", "", ".", "rng\\rank0.pt", "x\x00y",
             "rng/../extra.json", "./extra.json", "rng//rank0.pt", "é.distcp", "rng/rank1.pt"]


def _value(draw):
    return draw(st.sampled_from([None, True, -1, 0, 2**70, 1.5, "12", "", [], {}, "0" * 64]))


def mutate(draw, root: Path, kind: str, marker: Path, log: list) -> dict:
    """Apply one mutation of ``kind`` to a step of ``root``; returns flags (forged, template)."""
    steps = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
    step = steps[-1] if draw(st.integers(0, 4)) else steps[0]
    files = M.files_of(step) or ["manifest.json"]
    name = draw(st.sampled_from(files))
    path = step / name
    flags: dict = {}
    log.append((kind, step.name, name))
    try:
        if kind == "truncate" and path.is_file():
            size = path.stat().st_size
            os.truncate(path, draw(st.integers(0, max(0, size - 1))))
        elif kind == "flip" and path.is_file() and path.stat().st_size:
            raw = bytearray(path.read_bytes())
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << draw(st.integers(0, 7))
            path.write_bytes(bytes(raw))
        elif kind == "overwrite":
            M.with_unlink(path)
            path.write_bytes(draw(st.binary(max_size=300)))
        elif kind == "append" and path.is_file():
            with open(path, "ab") as handle:
                handle.write(draw(st.binary(min_size=1, max_size=64)))
        elif kind == "delete":
            M.with_unlink(path)
        elif kind == "delete-rng-dir":
            M.with_unlink(step / "rng")
        elif kind == "extra-file":
            new = step / draw(st.sampled_from(["x.distcp", "rng/rank1.pt", ".metadata.bak",
                                               "sub/dir/f", "__1_0.distcp", "manifest.json.tmp",
                                               "COMMITTED.tmp"]))
            new.parent.mkdir(parents=True, exist_ok=True)
            M.with_unlink(new)  # never write into a FIFO an earlier mutation left there
            new.write_bytes(draw(st.binary(max_size=100)))
        elif kind == "swap":
            other = step / draw(st.sampled_from(files))
            if path.is_file() and other.is_file() and other != path:
                a, b = path.read_bytes(), other.read_bytes()
                path.write_bytes(b)
                other.write_bytes(a)
        elif kind == "swap-across-steps" and len(steps) > 1:
            other = (steps[0] if step == steps[-1] else steps[-1]) / name
            if path.is_file() and other.is_file():
                a, b = path.read_bytes(), other.read_bytes()
                path.write_bytes(b)
                other.write_bytes(a)
        elif kind == "manifest":
            sub = draw(st.sampled_from(["size", "sha", "drop", "add", "files-type", "no-files",
                                        "top-type", "invalid", "non-utf8", "deep", "step",
                                        "hmac"]))
            log[-1] = (kind, sub, step.name, name)

            def edit(m):
                entries = m.get("files") if isinstance(m, dict) else None
                entries = entries if isinstance(entries, dict) else {}
                key = draw(st.sampled_from(sorted(entries))) if entries else "x"
                if sub == "size" and key in entries:
                    entries[key]["size"] = _value(draw)
                elif sub == "sha" and key in entries:
                    entries[key]["sha256"] = _value(draw)
                elif sub == "drop":
                    entries.pop(key, None)
                elif sub == "add":
                    entries[draw(st.sampled_from(ODD_NAMES))] = {"size": 0, "sha256": "0" * 64}
                elif sub == "files-type":
                    m["files"] = _value(draw)
                elif sub == "no-files":
                    m.pop("files", None)
                elif sub == "top-type":
                    return json.dumps(_value(draw))
                elif sub == "invalid":
                    return json.dumps(m)[: draw(st.integers(0, 40))]
                elif sub == "non-utf8":
                    return b"\xff\xfe" + json.dumps(m).encode()
                elif sub == "deep":
                    depth = draw(st.sampled_from([1000, 100_000]))
                    return "[" * depth + "]" * depth
                elif sub == "step":
                    m["step"] = _value(draw)
                elif sub == "hmac":
                    m["hmac"] = _value(draw)
                return None
            M.rewrite_manifest(step, edit)
        elif kind == "forge":
            M.forge(step)
            flags["forged"] = True
        elif kind == "metadata":
            sub = draw(st.sampled_from(["exploit", "exploit", "variant", "variant"]))
            if sub == "exploit":
                target = draw(st.sampled_from(M.CALL_TARGETS) | st.sampled_from(M.DOTTED_TARGETS))
                opcode = draw(st.sampled_from(["stack", "global", "inst"]))
                raw = M.exploit_pickle(target, marker, opcode)
                log[-1] = (kind, target, opcode, step.name)
            else:
                variants = M.metadata_variants()
                choice = draw(st.sampled_from(sorted(variants)))
                raw = variants[choice]
                log[-1] = (kind, choice, step.name)
            M.with_unlink(step / ".metadata")
            (step / ".metadata").write_bytes(raw)
            if sub == "exploit" or draw(st.integers(0, 3)):  # else verify stops at the hash
                M.forge(step)
                flags["forged"] = True
        elif kind == "rng":
            sub = draw(st.sampled_from(["exploit", "wrong-size", "float", "empty-dict", "list",
                                        "garbage", "no-cpu", "huge"]))
            target = draw(st.sampled_from(M.CALL_TARGETS) | st.sampled_from(M.DOTTED_TARGETS))
            log[-1] = (kind, sub, target if sub == "exploit" else "", step.name)
            raw = {
                "exploit": lambda: M.torch_zip_with_pickle(
                    M.exploit_pickle(target, marker, "stack")),
                "wrong-size": lambda: M.torch_bytes({"cpu": M.torch.zeros(3, dtype=M.torch.uint8)}),
                "float": lambda: M.torch_bytes({"cpu": M.torch.zeros(5056)}),
                "empty-dict": lambda: M.torch_bytes({}),
                "list": lambda: M.torch_bytes([1, 2]),
                "garbage": lambda: os.urandom(100),
                "no-cpu": lambda: M.torch_bytes({"cuda": M.torch.zeros(16, dtype=M.torch.uint8)}),
                "huge": lambda: M.torch_bytes({"cpu": M.torch.zeros(10**6, dtype=M.torch.uint8)}),
            }[sub]()
            (step / "rng").mkdir(exist_ok=True)
            M.with_unlink(step / "rng" / "rank0.pt")
            (step / "rng" / "rank0.pt").write_bytes(raw)
            if draw(st.integers(0, 3)):
                M.forge(step)
                flags["forged"] = True
        elif kind == "extra":
            sub = draw(st.sampled_from(["invalid", "list", "no-step", "step-str", "step-neg",
                                        "step-other", "deep", "non-utf8"]))
            log[-1] = (kind, sub, step.name)
            text = {"invalid": "{", "list": "[1]", "no-step": "{}", "step-str": '{"step": "2"}',
                    "step-neg": '{"step": -1}', "step-other": '{"step": 77}',
                    "deep": "[" * 100_000 + "]" * 100_000, "non-utf8": '{"step": 2, "x": "\xff"}'
                    }[sub]
            M.with_unlink(step / "extra.json")
            (step / "extra.json").write_bytes(text.encode("latin-1"))
            if draw(st.integers(0, 3)):
                M.forge(step)
                flags["forged"] = True
        elif kind == "symlink":
            sub = draw(st.sampled_from(["same-content", "other-file", "dangling", "self", "dir",
                                        "step-dir", "root-entry"]))
            log[-1] = (kind, sub, step.name, name)
            if sub == "step-dir":
                moved = root.parent / "real-step"
                shutil.move(str(step), moved)
                os.symlink(moved, step)
            elif sub == "root-entry":
                os.symlink(step, root / "step_99999999")
            else:
                copy_of = root.parent / "copy-of-file"
                if path.is_file():
                    shutil.copyfile(path, copy_of)
                M.with_unlink(path)
                target = {"same-content": copy_of, "other-file": step / "extra.json",
                          "dangling": step / "nowhere", "self": path, "dir": step}[sub]
                os.symlink(target, path)
        elif kind == "fifo":
            M.with_unlink(path)
            os.mkfifo(path)
        elif kind == "dir-for-file":
            M.with_unlink(path)
            path.mkdir()
            (path / "inner").write_text("x")
        elif kind == "marker":
            sub = draw(st.sampled_from(["empty", "garbage", "dir", "delete", "fifo"]))
            log[-1] = (kind, sub, step.name)
            marker_file = step / "COMMITTED"
            M.with_unlink(marker_file)
            if sub == "empty":
                marker_file.write_text("")
            elif sub == "garbage":
                marker_file.write_bytes(os.urandom(20))
            elif sub == "dir":
                marker_file.mkdir()
            elif sub == "fifo":
                os.mkfifo(marker_file)
        elif kind == "rename-step":
            new = draw(st.sampled_from(["step_00000002.partial", "step_abc", "step_99999999",
                                        "step_", "step_-1", "STEP_00000003", "step_٣"]))
            log[-1] = (kind, step.name, new)
            if not (root / new).exists():
                step.rename(root / new)
        elif kind == "noop" and path.is_file() and not path.is_symlink():
            path.write_bytes(path.read_bytes())  # same bytes, new mtime
        elif kind == "template":
            flags["template"] = draw(st.sampled_from(["missing-key", "extra-key", "shape",
                                                      "dtype", "value-for-tensor",
                                                      "tensor-for-value"]))
            log[-1] = (kind, flags["template"])
    except OSError as err:  # e.g. a FIFO or a folder where the next mutation expected a file
        log[-1] = (*log[-1], f"skipped: {err.strerror}")
    return flags


def make_template(kind: str | None, base: str = "plain") -> dict:
    if base == "hostile":
        return {"optim": {"param_groups.w.lr": 0.0}}
    t = M.template()
    if kind == "missing-key":
        t["model"].pop("b")
    elif kind == "extra-key":
        t["model"]["new"] = M.torch.zeros(2)
    elif kind == "shape":
        t["model"]["w"] = M.torch.zeros(3, 4)
    elif kind == "dtype":
        t["model"]["w"] = M.torch.zeros(4, 3, dtype=M.torch.float64)
    elif kind == "value-for-tensor":
        t["model"]["w"] = 0.0
    elif kind == "tensor-for-value":
        t["optim"]["param_groups.w.lr"] = M.torch.zeros(1)
    return t


def judge(root: Path, step: Path, marker: Path, forged: bool, signed: bool,
          template_kind: str | None, base: str = "plain") -> Outcome:
    """Call verify / latest_loadable / load; classify."""
    ck = M.ckpt_module()
    before = harness.snapshot(root.parent)
    results = []
    for call in ("verify", "latest_loadable", "load", "load-latest"):
        try:
            if call == "verify":
                ck.verify(step)
            elif call == "latest_loadable":
                found, refused = ck.latest_loadable(root)
                if not isinstance(refused, list):
                    return Outcome("other", f"latest_loadable returned {refused!r} as reasons")
                if found is not None:
                    ck.verify(found)  # what it chose must verify
            else:
                target = step
                if call == "load-latest":
                    found, _ = ck.latest_loadable(root)
                    if found is None:
                        continue
                    target = found
                tensors = make_template(template_kind, base)
                extra = ck.load(target, tensors)
                if template_kind is None and (not forged or signed) and base != "hostile":
                    diff = M.same_content(tensors, M.original_tensors())
                    if diff:
                        return Outcome("other", f"{call}({target.name}) loaded other content:"
                                                f" {diff}")
                    if not isinstance(extra, dict) or extra.get("note") != "fuzz":
                        return Outcome("other", f"{call} returned extra {extra!r}")
            results.append((call, "ok"))
        except ck.CheckpointError:
            results.append((call, "refused"))
        except Exception as exc:  # noqa: BLE001
            return harness.from_exception(exc, f"{call}: ")
        if marker.exists() or M.session_marker().exists():
            return Outcome("other", f"code ran: {call} made the marker folder")
    written = harness.changed_paths(before, harness.snapshot(root.parent))
    if written:
        return Outcome("other", f"loading wrote or changed {written[:5]}")
    kinds = {kind for _, kind in results}
    return Outcome("ok" if kinds == {"ok"} else "refused", repr(results))


def plant(root: Path, slot: str, target: tuple[str, str], opcode: str, marker: Path,
          forge: bool = True) -> None:
    """A pickle calling ``target`` (os.mkdir(marker) or the like) as the newest step's
    ``.metadata`` or RNG file, the manifest forged to match."""
    step = sorted(p for p in root.iterdir() if p.name.startswith("step_"))[-1]
    raw = M.exploit_pickle(target, marker, opcode)
    if slot == "rng":
        raw = M.torch_zip_with_pickle(raw)
        (step / "rng" / "rank0.pt").write_bytes(raw)
    else:
        (step / ".metadata").write_bytes(raw)
    if forge:
        M.forge(step)


def run_example(data, base: str, max_ops: int, ops: list[str] = OPS, first=None) -> None:
    bases = M.base_checkpoints()
    if base not in bases:  # no signing in this version of the module
        base = "plain"
    key_env = M.signing_env() if base == "signed" else None
    with workspace() as ws:
        root = ws / "ckpts"
        shutil.copytree(bases[base], root, symlinks=True)
        marker = ws / M.MARKER_NAME
        log: list = []
        flags: dict = {}
        if first is not None:  # a planted pickle before the random mutations
            slot, target, opcode, forged = first
            plant(root, slot, target, opcode, marker, forged)
            log.append(("plant", slot, target, opcode, "forged" if forged else "not forged"))
            flags["forged"] = forged
        for _ in range(data.draw(st.integers(1, max_ops))):
            kind = data.draw(st.sampled_from(ops))
            flags.update(M_flags := mutate(data.draw, root, kind, marker, log))
            if "forged" in M_flags:
                flags["forged"] = True
        steps = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
        step = steps[-1] if steps else root / "step_00000002"
        old = os.environ.get(key_env) if key_env else None
        if key_env:
            os.environ[key_env] = "fuzz-key"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                finished, outcome, error = harness.call_with_timeout(
                    lambda: judge(root, step, marker, flags.get("forged", False), bool(key_env),
                                  flags.get("template"), base),
                    HANG_SECONDS, lambda: harness.unblock_fifos(ws))
        finally:
            if key_env:
                os.environ.pop(key_env) if old is None else os.environ.__setitem__(key_env, old)
        if not finished:
            outcome = Outcome("other", f"hung for {HANG_SECONDS} s (blocked reading a FIFO?)")
        elif error is not None:
            outcome = harness.from_exception(error)
        check(f"checkpoint-{base}", outcome, log)


@fuzz_settings("checkpoint")
@given(st.data(), st.sampled_from(["plain", "plain", "plain", "signed"]))
def test_mutated_checkpoints_load_exactly_or_raise_checkpoint_error(data, base):
    run_example(data, base, 4)


@fuzz_settings("checkpoint_pickle")
@given(st.data())
def test_checkpoints_with_hostile_pickles_never_run_code(data):
    """The ``hostile`` checkpoint (a non-tensor value that is a pickled os.mkdir call, manifest
    consistent) and the plain one with crafted pickles planted and the manifest forged."""
    base = data.draw(st.sampled_from(["hostile", "plain", "plain"]))
    first = (data.draw(st.sampled_from(["metadata", "rng"])),
             data.draw(st.sampled_from(M.CALL_TARGETS) | st.sampled_from(M.DOTTED_TARGETS)),
             data.draw(st.sampled_from(["stack", "global", "inst"])),
             data.draw(st.sampled_from([True, True, True, False])))
    run_example(data, base, 2, PICKLE_OPS, first)


@pytest.mark.parametrize("slot", ["metadata", "rng"])
@pytest.mark.parametrize("opcode", ["stack", "global", "inst"])
@pytest.mark.parametrize("target", M.CALL_TARGETS, ids=lambda t: f"{t[0]}:{t[1]}")
def test_every_planted_pickle_is_refused_without_running_code(target, opcode, slot):
    """Each call target of ``CALL_TARGETS`` planted in each slot, the manifest forged to match:
    verify / latest_loadable / load refuse it (CheckpointError) and nothing runs."""
    base = M.base_checkpoints()["plain"]
    with workspace() as ws:
        root = ws / "ckpts"
        shutil.copytree(base, root, symlinks=True)
        marker = ws / M.MARKER_NAME
        plant(root, slot, target, opcode, marker)
        step = sorted(p for p in root.iterdir() if p.name.startswith("step_"))[-1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = judge(root, step, marker, True, False, None)
        if outcome.kind == "ok":
            outcome = Outcome("other", "a planted pickle loaded")
        check("checkpoint-planted", outcome, (slot, target, opcode))
        assert not marker.exists()
