"""Pretrained weights to start from (``model.init_from``), read a slice at a time.

``PretrainedSource.open(path)`` accepts a Hugging Face model directory (``config.json`` and
safetensors, one file or sharded by ``model.safetensors.index.json``; one of the families in
``loom.models.hf_config``) or a Loom run directory (``config.toml`` and ``model.safetensors``
under Loom's own names). ``args`` is the model shape it holds; ``read(name, offsets, shape)``
returns the region ``[offsets, offsets + shape)`` of the Loom parameter ``name`` as fp32, reading
only that region's bytes from the file (``safetensors``' lazy slices over a memory map), so a rank
that holds a shard of a parameter (tensor, pipeline, expert or ZeRO-3 parallelism) never reads the
rest. ``bytes_read`` counts what was read, for the loading benchmark.

Hugging Face stores the query and key rows of each head in rotate-half order where Loom rotates
interleaved pairs (``loom.models.hf``): a region of those rows is read widened to whole heads,
permuted, and cut back. Nothing is ever written under the source directory.

Why hand-written: DCP's Hugging Face storage reader loads whole tensors by
HF name into a state dict of the same names; it cannot rename, permute the RoPE basis or serve a
Loom run directory, and the load here is one slice per parameter with no collective.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loom.models.hf import (INDEX_FILE, SINGLE_FILE, WEIGHT_DTYPES, args_from_hf_file,
                            name_pairs, permute_from_hf, rope_heads, weight_dtype_rule,
                            weight_map)
from loom.errors import finite_float, is_int64, loads_toml, path_error, shortened
from loom.models.args import MAX_LAYERS, TransformerArgs
from loom.models import build_model

LOOM_WEIGHTS = "model.safetensors"
LOOM_CONFIG = "config.toml"


class PretrainedError(ValueError):
    """``model.init_from`` does not name a readable model; the message says what is missing."""


@dataclass
class PretrainedSource:
    """An opened pretrained model: its shape, where each Loom parameter lives, and the reads."""

    path: Path
    kind: str  # "hf" or "loom"
    args: TransformerArgs
    _files: dict[str, Path]  # stored tensor name -> file holding it
    _names: dict[str, str]  # Loom parameter name -> stored tensor name
    _open: dict[Path, Any] = field(default_factory=dict)
    bytes_read: int = 0

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> PretrainedSource:
        why = path_error(str(path))
        if why:
            raise PretrainedError(f"{shortened(str(path))!r} {why}")
        path = Path(path)
        if not path.is_dir():
            raise PretrainedError(f"{path} is not a directory (a Hugging Face model directory"
                                  " or a Loom run directory)")
        if (path / "config.json").is_file():
            return cls._open_hf(path)
        if (path / LOOM_CONFIG).is_file():
            return cls._open_loom(path)
        raise PretrainedError(f"{path} has neither config.json (a Hugging Face model) nor"
                              f" {LOOM_CONFIG} (a Loom run)")

    @classmethod
    def _open_hf(cls, path: Path) -> PretrainedSource:
        args = args_from_hf_file(path / "config.json")  # refuses what Loom cannot compute, by key
        files = _hf_tensor_files(path)
        names = dict(name_pairs(args))
        if args.tie_embeddings:  # the head is the embedding (an lm_head stored anyway is unused)
            names["output.weight"] = names["tok_embeddings.weight"]
        missing = sorted(hf for hf in names.values() if hf not in files)
        if missing:
            raise PretrainedError(f"{path}: the weights lack {missing[:3]}"
                                  f"{'...' if len(missing) > 3 else ''} that its config.json needs")
        return cls(path, "hf", args, files, names)._checked()

    @classmethod
    def _open_loom(cls, path: Path) -> PretrainedSource:
        try:
            table = loads_toml((path / LOOM_CONFIG).read_text())
        except (OSError, ValueError) as err:
            raise PretrainedError(f"{path / LOOM_CONFIG}: not readable TOML ({err})") from None
        model = table.get("model", {})
        defaults = TransformerArgs()
        shape = {}
        for key, value in (model.items() if isinstance(model, dict) else ()):
            if key not in {f.name for f in dataclasses.fields(TransformerArgs)}:
                continue
            want = type(getattr(defaults, key))
            if not isinstance(value, want) or isinstance(value, bool) != (want is bool):
                if not (want is float and isinstance(value, int) and not isinstance(value, bool)):
                    raise PretrainedError(f"{path / LOOM_CONFIG}: model.{key} = {value!r} is not"
                                          f" a {want.__name__}")
            shape[key] = _bounded(path / LOOM_CONFIG, key, want, value)
        args = TransformerArgs(**shape)
        if args.n_layers > MAX_LAYERS:  # before any per-layer name is listed
            raise PretrainedError(f"{path / LOOM_CONFIG}: model.n_layers = {args.n_layers} is"
                                  f" more than {MAX_LAYERS:,}")
        weights = path / LOOM_WEIGHTS
        if not weights.is_file():
            raise PretrainedError(f"{path}: no {LOOM_WEIGHTS} (a Loom run writes it at the end of"
                                  " training, or `loom hf import` does)")
        stored = _tensor_names(weights)
        names = {name: name for name in stored}
        if args.tie_embeddings:
            names.setdefault("output.weight", "tok_embeddings.weight")
        return cls(path, "loom", args, {name: weights for name in stored}, names)._checked()

    def _checked(self) -> PretrainedSource:
        """``self``, once every parameter of the model ``args`` describes is found stored whole
        in a type converted to fp32 exactly. Read from the files' headers while the config
        loads: a larger tensor would otherwise train silently on a corner of it, a smaller one
        fail in every worker after the run directory is written."""
        model = build_model(self.args, device="meta")
        for name, param in model.named_parameters():  # a tied head is yielded once
            if name not in self._names:
                raise PretrainedError(f"{self.path}: holds no weights for parameter {name!r}"
                                      " of the model its config describes")
            stored = self._names[name]
            lazy = self._handle(self._files[stored]).get_slice(stored)
            shape, dtype = tuple(lazy.get_shape()), lazy.get_dtype()
            if shape != tuple(param.shape):
                raise PretrainedError(f"{self._files[stored]}: {stored} has shape {shape}; the"
                                      f" model its config describes needs {tuple(param.shape)}")
            if dtype not in WEIGHT_DTYPES:
                raise PretrainedError(f"{self._files[stored]}: {stored} is stored as {dtype};"
                                      f" {weight_dtype_rule()}")
        return self

    # -- reading -------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._names

    def read(self, name: str, offsets: tuple[int, ...] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The region ``[offsets, offsets + shape)`` of Loom parameter ``name`` (the whole
        tensor when not given), fp32, reading only its bytes."""
        if name not in self._names:
            raise PretrainedError(f"{self.path}: holds no weights for parameter {name!r}")
        stored = self._names[name]
        handle = self._handle(self._files[stored])
        lazy = handle.get_slice(stored)
        full = tuple(lazy.get_shape())
        offsets = offsets or (0,) * len(full)
        shape = shape or full
        if len(offsets) != len(full) or any(o + s > f for o, s, f in zip(offsets, shape, full)):
            raise PretrainedError(f"{self.path}: {stored} has shape {full}; the model needs the"
                                  f" region at {offsets} of shape {shape}")
        heads = rope_heads(name, self.args) if self.kind == "hf" else 0
        if not heads:
            return self._take(lazy, offsets, shape)
        # RoPE basis: widen the rows to whole heads, permute them into Loom's order, cut back
        per_head = full[0] // heads
        first = offsets[0] // per_head * per_head
        last = math.ceil((offsets[0] + shape[0]) / per_head) * per_head
        rows = self._take(lazy, (first, *offsets[1:]), (last - first, *shape[1:]))
        rows = (permute_from_hf(rows[:, None], rows.shape[0] // per_head)[:, 0] if rows.ndim == 1
                else permute_from_hf(rows, rows.shape[0] // per_head))
        return rows[offsets[0] - first: offsets[0] - first + shape[0]].contiguous()

    def _take(self, lazy: Any, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        tensor = lazy[index] if index else lazy[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.float()

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types on a bad header
                raise PretrainedError(f"{file}: not a readable safetensors file ({err})") from None
        return self._open[file]


def _bounded(config: Path, key: str, want: type, value: Any) -> Any:
    """``want(value)`` for a field of a Loom run's config.toml, refusing what the config's own
    reader refuses (``loom.config`` sits above this module): an integer beyond int64, a float
    that is infinite, NaN, or an integer no float holds."""
    if want is int and not is_int64(value):
        raise PretrainedError(f"{config}: model.{key} = {value} is not a 64-bit integer")
    if want is float:
        number = finite_float(value)
        if number is None:
            raise PretrainedError(f"{config}: model.{key} = {shortened(str(value))} is not a"
                                  " finite number")
        value = number
    return want(value)


def _tensor_names(file: Path) -> list[str]:
    """The tensor names of a safetensors file; its header and size are checked (a truncated or
    corrupt file is a ``PretrainedError`` here, before anything starts), the tensors not read."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as err:  # safetensors raises its own error types on a bad file
        raise PretrainedError(f"{file}: not a readable safetensors file ({err})") from None


def _hf_tensor_files(path: Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file holding it, from one file or the index."""
    if (path / SINGLE_FILE).is_file():
        return {name: path / SINGLE_FILE for name in _tensor_names(path / SINGLE_FILE)}
    if (path / INDEX_FILE).is_file():
        out = {}
        for name, shard in weight_map(path / INDEX_FILE).items():
            if not (path / shard).is_file():
                raise PretrainedError(f"{path / INDEX_FILE}: shard {shard!r} is not a file in"
                                      " the model directory")
            out[name] = path / shard
        return out
    raise PretrainedError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (Loom reads safetensors"
                          " only, never pickled .bin/.pt weights)")


__all__ = ["PretrainedSource", "PretrainedError", "LOOM_CONFIG", "LOOM_WEIGHTS"]
