"""The errors every floor may raise for bad input: the ground floor, importing nothing.

``ConfigError`` names the field, the value and the rule; ``loom train`` prints it as one line and
exits 2. It lives here, not in ``loom.config``, so the data layer (which checks corpora) and the
config schema (which imports the data layer's tokenizer sizes) need not import each other.
``OneLineParser`` is the argument parser of every ``loom`` command: a bad flag is one line and
exit 2, like a bad config value, not argparse's usage dump. ``read_input_text`` reads a text file
the user named (a config, a cluster, costs, hardware, lengths) without hanging or exhausting
memory on a device, a FIFO or a huge file; each reader turns its ``InputFileError`` into its
own one-line refusal. ``loads_json`` and ``loads_toml`` parse such a text: a value nested deeper
than the parsers' recursion (``[[[[...`` a few thousand deep) raises their own decode error,
which every reader already turns into one line, instead of ``RecursionError``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from typing import Any, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

EXIT_BAD_INPUT = 2
# far above any real input file of these kinds (the largest, a cost CSV of 10^4 stages, is < 1 MB)
MAX_INPUT_BYTES = 64 * 2**20


class ConfigError(ValueError):
    """A config value breaks a rule. ``str()`` names the field, the value and the rule."""

    def __init__(self, field_name: str, value: Any, rule: str) -> None:
        self.field_name, self.value, self.rule = field_name, value, rule
        # one line whatever the user typed: a key with a line break is shown escaped
        shown = field_name if field_name.isprintable() else repr(field_name)[1:-1]
        super().__init__(f"config error: {shown}={value!r}: {rule}")


def is_int64(value: int) -> bool:
    """Whether ``value`` fits a 64-bit signed integer, what torch, numpy and checkpoints hold."""
    return -2 ** 63 <= value < 2 ** 63


def finite_float(value: Any) -> float | None:
    """``float(value)`` when it is finite; None for NaN, infinity and an integer beyond any
    float (TOML and JSON readers take 1 followed by 400 zeros). The one place these rules live
    for the config, the Hugging Face and the pretrained-run readers."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def suggest(name: str, options: list[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``options`` to a misspelled ``name``, or ""."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad argument as one line naming it (no usage dump), exit code 2; its
    sub-commands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


# Linux's limits on a path the kernel takes: bytes per name between slashes, and in all (one less
# than PATH_MAX for the terminating NUL). Past them every call raises ENAMETOOLONG, which
# ``Path.exists`` does not swallow; a NUL byte raises ValueError in every call.
NAME_MAX, PATH_MAX = 255, 4095


def path_error(path: str) -> str | None:
    """Why no file system call can take ``path`` (too long, a name too long, a NUL), or None."""
    if "\0" in path:
        return "holds a NUL character"
    raw = os.fsencode(path)
    longest = max((len(name) for name in raw.split(b"/")), default=0)
    if len(raw) > PATH_MAX or longest > NAME_MAX:
        return (f"is not a usable path: {len(raw):,} bytes with a name of {longest:,} (at most"
                f" {PATH_MAX:,} in all and {NAME_MAX} per name)")
    return None


def shortened(text: str, keep: int = 60) -> str:
    """``text`` itself, or its first and last ``keep // 2`` characters around an ellipsis."""
    return text if len(text) <= keep else f"{text[:keep // 2]}...{text[-(keep // 2):]}"


def path_arg(text: str) -> str:
    """An argparse ``type`` for a flag that names a file or directory: ``path_error`` as the
    one-line usage error, before the command touches the file system."""
    why = path_error(text)
    if why:
        raise argparse.ArgumentTypeError(f"{shortened(text)!r} {why}")
    return text


class InputFileError(ValueError):
    """A named input file that cannot be read as text: ``str()`` is ``"PATH: RULE"``."""

    def __init__(self, path: str, rule: str) -> None:
        self.path, self.rule = path, rule
        super().__init__(f"{path}: {rule}")


def read_input_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of the file at ``path``, or ``InputFileError`` naming why not: missing, a
    directory, not a regular file (never opened: /dev/zero never ends, a FIFO blocks), larger
    than ``MAX_INPUT_BYTES``, unreadable, or not UTF-8."""
    shown = os.fspath(path)
    try:
        if os.path.isdir(shown):
            raise InputFileError(shown, "is a directory, not a file")
        if not os.path.exists(shown):
            raise InputFileError(shown, "file does not exist")
        if not os.path.isfile(shown):
            raise InputFileError(shown, "is not a regular file")
        with open(shown, "rb") as handle:
            data = handle.read(MAX_INPUT_BYTES + 1)
    except OSError as err:
        raise InputFileError(shown, f"cannot be read: {err.strerror}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise InputFileError(shown, f"is larger than {MAX_INPUT_BYTES // 2**20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(shown, f"is not UTF-8 text (byte {err.start}: {err.reason})") from None


_TOO_DEEP = "nested too deeply (more than Python's recursion limit of levels)"


def loads_json(text: str) -> Any:
    """``json.loads``; a value nested too deeply is a ``json.JSONDecodeError`` like any other."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(_TOO_DEEP, text, 0) from None


def read_input_json(path: str | os.PathLike) -> Any:
    """The JSON value in the file at ``path`` (``read_input_text``'s checks, then
    ``loads_json``), or ``InputFileError`` naming the file and why not, malformed JSON too."""
    text = read_input_text(path)
    try:
        return loads_json(text)
    except json.JSONDecodeError as err:
        raise InputFileError(os.fspath(path), f"is not valid JSON ({err})") from None


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads``; a value nested too deeply is a ``TOMLDecodeError`` like any other."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError(_TOO_DEEP) from None
