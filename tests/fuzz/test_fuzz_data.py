"""Fuzzing the data source: ``data.*`` fields over random file trees.

Each example builds a tree in a fresh workspace: text, random bytes, empty files, binary files
(NUL bytes), invalid UTF-8, deep folders, odd names, symlinks (to files, to folders, dangling, to
themselves, to a parent: a loop), FIFOs. Then ``loom train`` gets ``data.source`` = the tree, an
entry of it (a file, a folder, a link, a FIFO), a path that does not exist, plus random
``data.extensions`` / ``tokenizer`` / ``seq_len`` / ``val_fraction`` / ``max_bytes``.

Property: exit 2 with one line before anything is written, or exit 0 (workers replaced by a stub:
the token files are prepared for real) having changed nothing outside the run directory. Never a
traceback, never a hang on a FIFO.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import harness, strategies as S
from tests.fuzz.harness import check, fuzz_settings, workspace

NAMES = ["a", "b.txt", "c.py", "d.md", "e.bin", ".hidden.txt", "ünï.txt", "sp ace.py", "n\nl.txt",
         "x" * 200 + ".txt", "site-packages", "__pycache__", "-dash.py", "UPPER.TXT", "f.py.txt"]
KINDS = ["text", "text", "text", "bytes", "empty", "nul", "invalid-utf8", "crlf", "one-byte",
         "dir", "link-file", "link-dir", "link-dangling", "link-self", "link-loop", "fifo"]


@st.composite
def trees(draw) -> list[tuple[str, str, bytes]]:
    """[(relative path, kind, payload)]: parents first; kinds as in KINDS."""
    entries = []
    for _ in range(draw(st.integers(0, 8))):
        depth = draw(st.integers(0, 7))
        parts = [draw(st.sampled_from(["d", "sub", "deep", "site-packages", "ü"]))
                 for _ in range(depth)] + [draw(st.sampled_from(NAMES))]
        kind = draw(st.sampled_from(KINDS))
        if draw(st.integers(0, 2)) == 0:
            kind, parts[-1] = "text", draw(st.sampled_from(["t.txt", "m.md", "p.py"]))
        payload = b""
        if kind == "text":
            payload = draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=3000)
                           ).encode("utf-8", "surrogatepass")
            payload *= draw(st.sampled_from([1, 1, 1, 20]))
        elif kind == "bytes":
            payload = draw(st.binary(min_size=1, max_size=2000))
        elif kind == "nul":
            payload = b"def f():\n    return 1\n" * 10 + b"\x00" + b"x = 2\n" * 10
        elif kind == "invalid-utf8":
            payload = b"caf\xe9 \xff\xfe " * draw(st.integers(1, 400))
        elif kind == "crlf":
            payload = b"line one\r\nline two\r\n" * draw(st.integers(1, 300))
        elif kind == "one-byte":
            payload = b"x"
        entries.append(("/".join(parts), kind, payload))
    return entries


def build(root: Path, entries: list[tuple[str, str, bytes]]) -> list[str]:
    """Make the tree under ``root``; returns the relative paths that exist (some collide)."""
    made = []
    (root / "elsewhere").mkdir(exist_ok=True)
    (root / "elsewhere" / "outside.txt").write_text("text outside the tree\n" * 50)
    for rel, kind, payload in entries:
        path = root / "tree" / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(path):
                continue
            if kind == "dir":
                path.mkdir()
            elif kind == "link-file":
                target = made[-1] if made else "elsewhere/outside.txt"
                os.symlink(root / target, path)
            elif kind == "link-dir":
                os.symlink(root / "elsewhere", path)
            elif kind == "link-dangling":
                os.symlink(root / "nowhere" / "x.txt", path)
            elif kind == "link-self":
                os.symlink(path.name, path)
            elif kind == "link-loop":
                os.symlink("..", path)
            elif kind == "fifo":
                os.mkfifo(path)
            else:
                path.write_bytes(payload)
        except OSError:  # a name collides with a file made earlier, or is too long
            continue
        made.append(str(path.relative_to(root)))
    (root / "tree").mkdir(exist_ok=True)
    return made


def _mostly(valid: list[str], key: str) -> st.SearchStrategy[str]:
    """A valid value 7 times in 8, else anything (wrong type, out of range, odd text)."""
    return st.integers(0, 7).flatmap(
        lambda i: st.sampled_from(valid) if i else S.text_value(key))


@st.composite
def data_fields(draw) -> dict[str, str]:
    out = {}
    if draw(st.booleans()):
        out["data.extensions"] = draw(_mostly(S.SPECIAL["data.extensions"], "data.extensions"))
    out["data.tokenizer"] = draw(st.sampled_from(["byte", "byte", "bpe"]))
    if out["data.tokenizer"] == "bpe" or draw(st.booleans()):
        out["data.bpe_vocab_size"] = draw(_mostly(["260", "300", "512", "259"],
                                                  "data.bpe_vocab_size"))
    out["data.seq_len"] = draw(_mostly(["1", "2", "8", "8", "16", "64", "200"], "data.seq_len"))
    if draw(st.booleans()):
        out["data.val_fraction"] = draw(_mostly(["0.05", "0.5", "0.9", "0.999", "1e-9"],
                                                "data.val_fraction"))
    if draw(st.booleans()):
        out["data.max_bytes"] = draw(_mostly(["0", "1", "10", "100", "5000", "100000"],
                                             "data.max_bytes"))
    return out


BASE = ["--model.preset=debug", "--train.steps=1", "--train.global_batch_size=2",
        "--train.micro_batch_size=1", "--train.run_dir=run", "--metrics.progress=false"]


@fuzz_settings("data")
@given(trees(), st.data(), data_fields())
def test_data_sources_are_refused_before_writing_or_accepted(entries, data, fields):
    with workspace() as root:
        made = build(root, entries)
        source = data.draw(st.sampled_from(["tree", "tree/", "tree/missing.txt", ".", "elsewhere",
                                            *made, *made]) if made else
                           st.sampled_from(["tree", "tree/", "tree/missing.txt"]))
        overrides = {**fields, "data.source": source}
        argv = BASE + [f"--{k}={v}" for k, v in harness.contain_paths(overrides).items()]
        finished, outcome, error = harness.call_with_timeout(
            lambda: harness.run_cli(argv, root), 120, lambda: harness.unblock_fifos(root))
        if not finished:
            outcome = harness.Outcome("other", "hung (blocked on a FIFO?) for 120 s")
        elif error is not None:
            outcome = harness.from_exception(error)
        check("data", outcome, {"tree": [(p, k, len(b)) for p, k, b in entries], "argv": argv})
