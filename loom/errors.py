"""The errors every floor may raise for bad input: the ground floor, importing nothing.

``ConfigError`` names the field, the value and the rule; ``loom train`` prints it as one line and
exits 2. It lives here, not in ``loom.config``, so the data layer (which checks corpora) and the
config schema (which imports the data layer's tokenizer sizes) need not import each other.
``OneLineParser`` is the argument parser of every ``loom`` command: a bad flag is one line and
exit 2, like a bad config value, not argparse's usage dump.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

EXIT_BAD_INPUT = 2


class ConfigError(ValueError):
    """A config value breaks a rule. ``str()`` names the field, the value and the rule."""

    def __init__(self, field_name: str, value: Any, rule: str) -> None:
        self.field_name, self.value, self.rule = field_name, value, rule
        # one line whatever the user typed: a key with a line break is shown escaped
        shown = field_name if field_name.isprintable() else repr(field_name)[1:-1]
        super().__init__(f"config error: {shown}={value!r}: {rule}")


def suggest(name: str, options: list[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``options`` to a misspelled ``name``, or ""."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad argument as one line naming it (no usage dump), exit code 2; its
    sub-commands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")
