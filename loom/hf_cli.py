"""``loom hf import | export``: move weights between Loom runs and Hugging Face directories.

The families are Llama (2, 3.x), Qwen2/2.5, Qwen3 and Mistral (``loom.models.hf_config``).
``loom hf import HF_DIR --run RUN_DIR`` reads a ``transformers`` ``*ForCausalLM`` directory
(``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``) and
writes a Loom run directory: ``config.toml`` with every model field explicit, and
``model.safetensors`` in Loom's names and RoPE layout (fp32), the two files ``loom generate`` and
``read_run`` read. The tokenizer is not converted, so the run has no ``data/``.

``loom hf export RUN_DIR OUT_DIR`` writes the run's ``config.toml`` + ``model.safetensors`` as an
HF directory (``config.json`` + ``model.safetensors``) that
``AutoModelForCausalLM.from_pretrained`` loads, of the family that holds the model's features
(Qwen3 for q/k norms, Qwen2 for q/k/v biases, Mistral for a sliding window, else Llama). Neither
direction needs ``transformers`` installed; the conversion itself is ``loom.models.hf``.

``add_hf_commands(subparsers)`` registers ``hf`` on the top-level ``loom`` parser; ``main(argv)``
runs these commands on their own (tests, ``python -m loom.hf_cli``). A checkpoint Loom cannot
convert exactly, a missing or unreadable file, or a shape no run could train prints one line
naming the field or file and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from loom.config import Config, load_config, model_args, to_toml
from loom.config_rules import validate_model_shape
from loom.errors import ConfigError, InputFileError, OneLineParser, path_arg, read_input_json
from loom.models.hf import (HFConversionError, SINGLE_FILE, atomic_save_safetensors,
                            load_safetensors, read_hf_checkpoint, read_hf_config,
                            write_hf_checkpoint)
from loom.models.args import TransformerArgs

EXIT_USAGE = 2
CONFIG_FILE = "config.toml"


def run_config(args: TransformerArgs) -> Config:
    """The Loom config of a model shape, held to the model section's rules (``ConfigError``
    names the first it breaks: a shape no Loom run could train, or too large to enumerate)."""
    # Every shape field is explicit, so the preset (the default one) contributes nothing.
    config = load_config(None, {f"model.{k}": v for k, v in dataclasses.asdict(args).items()})
    validate_model_shape(config)
    return config


def write_run(run_dir: str | Path, args: TransformerArgs, state: dict[str, torch.Tensor],
              origin: str = "") -> None:
    """A Loom run directory holding a model: ``config.toml`` and ``model.safetensors``."""
    run_dir = Path(run_dir)
    config = run_config(args)
    config.train.run_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(state, run_dir / SINGLE_FILE, {"loom_origin": origin})
    header = (f"# Imported by `loom hf import` from {origin}; model.preset is unused.\n"
              if origin else "")
    (run_dir / CONFIG_FILE).write_text(header + to_toml(config))


def read_run(run_dir: str | Path) -> tuple[TransformerArgs, dict[str, torch.Tensor]]:
    """A run's model shape (from ``config.toml``) and final weights (``model.safetensors``)."""
    run_dir = Path(run_dir)
    for name in (CONFIG_FILE, SINGLE_FILE):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} not found: not a finished Loom run")
    config = load_config(run_dir / CONFIG_FILE, pretrained=False)
    validate_model_shape(config)  # before the names of every layer are listed
    return model_args(config), load_safetensors(run_dir / SINGLE_FILE)


def import_hf(hf_dir: str | Path, run_dir: str | Path) -> TransformerArgs:
    """Convert an HF model directory into a Loom run directory; returns the model shape."""
    args = read_hf_config(hf_dir)
    run_config(args)  # refused before any weight is read or anything written
    args, state = read_hf_checkpoint(hf_dir, args)
    write_run(run_dir, args, state, origin=str(Path(hf_dir).resolve()))
    return args


def _tokenizer_ids(run_dir: Path) -> dict[str, Any]:
    """The end-of-document id of the run's tokenizer, so HF generation stops where Loom's does."""
    meta = run_dir / "data" / "tokenizer_meta.json"
    if not meta.is_file():
        return {}
    try:
        data = read_input_json(meta)
    except InputFileError as err:
        raise HFConversionError(f"{meta}: not a tokenizer description ({err})") from None
    eos = data.get("eos_id") if isinstance(data, dict) else None
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < 2**31:
        raise HFConversionError(f"{meta}: eos_id {eos!r} must be a token id (an integer >= 0)")
    return {"eos_token_id": eos, "bos_token_id": None}


def export_hf(run_dir: str | Path, out_dir: str | Path) -> TransformerArgs:
    """Convert a Loom run's model into an HF model directory; returns the model shape."""
    args, state = read_run(run_dir)
    write_hf_checkpoint(out_dir, args, state, extra_config=_tokenizer_ids(Path(run_dir)))
    return args


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} already exist (--overwrite replaces them)")


def _describe(args: TransformerArgs) -> str:
    features = [name for name, on in (
        ("tied embeddings", args.tie_embeddings), ("q/k/v biases", args.qkv_bias),
        ("q/k norms", args.qk_norm), (f"head dim {args.head_dim}", args.head_dim_override),
        (f"sliding window {args.sliding_window}", args.sliding_window),
        (f"{args.rope_scaling} RoPE scaling", args.rope_scaling != "none")) if on]
    return (f"{args.n_layers} layers, dim {args.dim}, {args.n_heads} heads / {args.n_kv_heads} kv,"
            f" vocab {args.vocab_size}" + "".join(f", {f}" for f in features))


def _run(command: str, convert: Callable[[], TransformerArgs], target: Path, outputs: list[str],
         args: argparse.Namespace, extra: list[str]) -> int:
    """Shared error handling of both commands: one line and exit 2 for a bad input (a model
    the conversion refuses, a missing input, an output that exists or cannot be written)."""
    if extra:
        print(f"loom hf {command}: unexpected arguments {extra}", file=sys.stderr)
        return EXIT_USAGE
    try:
        _refuse_existing([target / name for name in outputs], args.overwrite)
        shape = convert()
    except (HFConversionError, ConfigError) as err:
        print(f"loom hf {command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:  # FileNotFoundError, FileExistsError, an unwritable target
        print(f"loom hf {command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {target} ({_describe(shape)})")
    return 0


def _import(args: argparse.Namespace, extra: list[str]) -> int:
    return _run("import", lambda: import_hf(args.hf_dir, args.run), Path(args.run),
                [CONFIG_FILE, SINGLE_FILE], args, extra)


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    return _run("export", lambda: export_hf(args.run_dir, args.out_dir), Path(args.out_dir),
                ["config.json", SINGLE_FILE], args, extra)


def add_hf_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hf import`` and ``hf export`` on ``subparsers`` (from ``add_subparsers``)."""
    hf = subparsers.add_parser("hf", help="import / export Hugging Face checkpoints",
                               description="Convert between Loom runs and Hugging Face"
                                           " LlamaForCausalLM, Qwen2ForCausalLM,"
                                           " Qwen3ForCausalLM and MistralForCausalLM directories"
                                           " (safetensors only).")
    sub = hf.add_subparsers(dest="hf_command", required=True, metavar="COMMAND")
    imp = sub.add_parser("import", help="HF directory -> Loom run (config.toml, model.safetensors)")
    imp.add_argument("hf_dir", type=path_arg, metavar="HF_DIR",
                     help="directory with config.json and safetensors")
    imp.add_argument("--run", type=path_arg, required=True, metavar="RUN_DIR",
                     help="Loom run directory to write")
    imp.add_argument("--overwrite", action="store_true", help="replace existing files")
    imp.set_defaults(handler=_import)
    exp = sub.add_parser("export", help="Loom run -> HF directory (config.json, model.safetensors)")
    exp.add_argument("run_dir", type=path_arg, metavar="RUN_DIR",
                     help="a finished run (config.toml + weights)")
    exp.add_argument("out_dir", type=path_arg, metavar="OUT_DIR", help="HF directory to write")
    exp.add_argument("--overwrite", action="store_true", help="replace existing files")
    exp.set_defaults(handler=_export)
    return hf


def main(argv: list[str] | None = None) -> int:
    """Run ``hf ...`` commands without the rest of ``loom``."""
    parser = OneLineParser(prog="loom")
    add_hf_commands(parser.add_subparsers(dest="command", required=True))
    args, extra = parser.parse_known_args(argv)
    return args.handler(args, extra)


if __name__ == "__main__":
    sys.exit(main())
