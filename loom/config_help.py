"""The config keys as ``loom train --help`` lists them: every key, its default, its description.

The descriptions are the comments written next to the dataclass fields (``loom/config.py``, and
``loom/models/layers.py`` for the model shape ``ModelConfig`` inherits): one place to write them,
read back here from the source with ``tokenize`` (the comments) and ``ast`` (which line holds
which field) rather than copied into a second table that would drift from the first. Python keeps
no comments at run time, hence the source. The rules, in the order they apply to a field:

* a comment after the field on its own line(s) describes that field alone;
* else the block of comment lines right above it (no blank line between);
* else, for a field that directly follows another field without a comment of its own (no blank
  line), the block above that one: one block may describe a run of fields.

``missing_descriptions()`` names the keys none of those reach; a test keeps that list empty, so
a field added without a comment fails the suite.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from functools import lru_cache
from pathlib import Path
from typing import Literal

from loom.config import Config, load_config, to_toml


def _clean(comment: str) -> str:
    return comment.lstrip("#").strip().replace("``", "`")


@lru_cache(maxsize=None)
def _class_comments(cls: type) -> dict[str, str]:
    """Field name -> description, for the fields annotated in ``cls``'s own body."""
    path = inspect.getsourcefile(cls)
    if path is None:  # pragma: no cover - a class built at run time has no source
        return {}
    source = Path(path).read_text(encoding="utf-8")
    node = next((n for n in ast.walk(ast.parse(source))
                 if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    if node is None:  # pragma: no cover - defined by exec or renamed after definition
        return {}
    trailing: dict[int, str] = {}  # line -> a comment after code on that line
    own_line: dict[int, str] = {}  # line -> a comment alone on its line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line.strip().startswith("#")
            (own_line if alone else trailing)[tok.start[0]] = _clean(tok.string)
    out: dict[str, str] = {}
    block = ""  # the comment block of the current run of fields
    previous_end = None  # last line of the previous field of the run, None after a gap
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            previous_end = None
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line in own_line:
            above.insert(0, own_line[line])
            line -= 1
        if above:
            block = " ".join(above)
        elif previous_end != stmt.lineno - 1:  # not right under the previous field: a new run
            block = ""
        own = " ".join(trailing[n] for n in range(stmt.lineno, stmt.end_lineno + 1)
                       if n in trailing)
        if own or block:
            out[stmt.target.id] = own or block
        previous_end = stmt.end_lineno
    return out


def field_description(cls: type, name: str) -> str:
    """The comment that describes field ``name`` of dataclass ``cls`` ("" when there is none),
    read from the class that declares it (a subclass may redeclare an inherited field)."""
    for klass in cls.__mro__:
        if name in inspect.get_annotations(klass):
            return _class_comments(klass).get(name, "")
    return ""


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def key_descriptions() -> dict[str, str]:
    """``"section.key"`` -> its description, for every key of the config, in schema order."""
    return {f"{section}.{f.name}": field_description(cls, f.name)
            for section, cls in _sections().items() for f in dataclasses.fields(cls)}


def missing_descriptions() -> list[str]:
    """The keys whose field has no comment (kept empty by a test)."""
    return [key for key, text in key_descriptions().items() if not text]


def _defaults() -> dict[str, str]:
    """``"section.key"`` -> its default as a TOML literal: what an empty command line gets (the
    model shape is the default preset's), written by the same ``to_toml`` as a run's config."""
    out, section = {}, ""
    for line in to_toml(load_config(None)).splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif " = " in line:
            key, value = line.split(" = ", 1)
            out[f"{section}.{key}"] = value
    return out


def help_text(width: int = 100) -> str:
    """Every section and key with its default and description, for ``loom train --help``.
    Keys that share one comment block are listed together above it."""
    descriptions, defaults = key_descriptions(), _defaults()
    lines = ["config keys (--section.key=value, or key = value under [section] in --config FILE):"]
    for section, cls in _sections().items():
        note = (f"  (shape fields default to the preset's; shown: {defaults['model.preset']})"
                if section == "model" else "")
        lines += ["", f"[{section}]{note}"]
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        for i, name in enumerate(names):
            key = f"{section}.{name}"
            choices = ""
            if typing.get_origin(hints[name]) is Literal:
                choices = "  (" + " | ".join(map(str, typing.get_args(hints[name]))) + ")"
            lines.append(f"  {name} = {defaults[key]}{choices}")
            following = f"{section}.{names[i + 1]}" if i + 1 < len(names) else None
            if following is None or descriptions[following] != descriptions[key]:
                lines.append(textwrap.fill(descriptions[key] or "(no description)", width,
                                           initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


__all__ = ["field_description", "key_descriptions", "missing_descriptions", "help_text"]
