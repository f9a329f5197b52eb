"""``loom data prepare``: the command-line face of ``loom.data.prepare``.

``loom data prepare --source S --tokenizer T --out DIR [--workers N] [--text-field F]`` checks every
input before writing anything; a bad one prints one line naming the option and exits 2, as
``loom train`` does for its config. The directory it writes is a ``data.source`` for ``loom train``.
"""

from __future__ import annotations

import argparse
import os
import sys

from loom.data.prepare import prepare
from loom.errors import ConfigError, path_arg

EXIT_CONFIG_ERROR = 2
# The data layer names config fields; this command's options stand for them.
_OPTION_OF = {"data.source": "--source", "data.tokenizer": "--tokenizer",
              "data.text_field": "--text-field", "out": "--out", "workers": "--workers"}


def _prepare(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        print(f"loom data prepare: unexpected arguments {extra}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        manifest = prepare(args.source, args.tokenizer, args.out, workers=args.workers,
                           text_field=args.text_field, progress=not args.quiet,
                           overwrite=args.overwrite)
    except ConfigError as err:
        err = ConfigError(_OPTION_OF.get(err.field_name, err.field_name), err.value, err.rule)
        print(f"loom data prepare: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"{args.out}: {manifest['num_docs']:,} documents, {manifest['num_tokens']:,} tokens"
          f" ({manifest['dtype']}, tokenizer {manifest['tokenizer']['kind']}"
          f" {manifest['tokenizer']['identity'][:12]})")
    return 0


def add_data_commands(sub: argparse._SubParsersAction) -> None:
    """``loom data ...`` on the ``loom`` command's subparsers."""
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare", help="tokenize a source once into a memory-mapped token file",
        description="Tokenize a text corpus, a .jsonl/.parquet/.arrow file or a datasets"
                    " save_to_disk directory into DIR (tokens.bin, doc_index.bin, prepared.json,"
                    " tokenizer/), for --data.source=DIR.")
    prep.add_argument("--source", type=path_arg, required=True,
                      help="stdlib, a text file or directory, a .jsonl / .parquet / .arrow file"
                           " or a datasets save_to_disk directory")
    prep.add_argument("--tokenizer", type=path_arg, required=True,
                      help="byte, or a Hugging Face tokenizer.json (or a directory holding one)")
    prep.add_argument("--out", type=path_arg, required=True,
                      help="directory to write (must not exist or be empty)")
    prep.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                      help="tokenizer processes (default: the cores, at most 8)")
    prep.add_argument("--text-field", default="text", help="column holding the text (default"
                                                           " text)")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace an existing prepared directory at --out")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(handler=_prepare)
