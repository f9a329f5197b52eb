"""Hugging Face tokenizers: a ``tokenizer.json`` (and its configuration files) loaded offline.

``load_hf_tokenizer(path)`` takes a ``tokenizer.json`` file or a directory holding one, plus the
``tokenizer_config.json`` / ``special_tokens_map.json`` next to it when present. Encoding is the
``tokenizers`` library's own (Rust); nothing of the tokenizer is re-implemented. What Loom adds is
only the policy around document boundaries, read from the tokenizer's own configuration:

* **beginning of a document**: when ``tokenizer_config.json`` says ``add_bos_token`` (or
  ``add_eos_token``), those flags decide, as ``transformers``' Llama/Gemma tokenizers rebuild their
  post-processor from them; otherwise the ``tokenizer.json`` post-processor decides (e.g. Llama 3's
  template adds ``<|begin_of_text|>``, GPT-2's adds nothing). The post-processor's single-sequence
  template is probed once (``encode("a")`` with and without special tokens) and applied as a fixed
  prefix / suffix around ``encode_batch(..., add_special_tokens=False)``, so batches stay in Rust.
* **end of a document**: every document is followed by the end-of-sequence token (``eos_token``
  of the configuration, else a conventional one found in the vocabulary), once: not twice when the
  template or ``add_eos_token`` already ends the document with it. A tokenizer without any
  end-of-sequence token is refused: packed documents would run into each other unmarked.

``HfTokenizer.identity`` is a SHA-256 of ``tokenizer.json`` and of that policy, so token files
prepared by ``loom data prepare`` can be matched to the tokenizer of a run.

On disk (a run's ``data/`` directory, a prepared directory's ``tokenizer/``) it is the library's
files copied as they are, plus Loom's ``tokenizer_meta.json`` (kind ``"hf"``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from loom.errors import ConfigError, InputFileError, path_error, read_input_json

KIND = "hf"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
# When the configuration names no eos_token: the end-of-sequence tokens of common families
# (GPT-2 / Qwen, Llama 1-2 / Mistral / T5, Llama 3 base, Gemma), looked up in the vocabulary.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
ID_DTYPE = np.int32  # as loom.data.tokenizer: every id of a vocabulary below 2**31


def tokenizer_file(path: str | os.PathLike[str]) -> Path | None:
    """The ``tokenizer.json`` that ``path`` names (the file itself, or the one in a directory),
    or None when there is none (or ``path`` could not name a file: ``path_error``)."""
    if path_error(os.fspath(path)):
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    return p if p.is_file() else None


def _token_content(value: Any) -> str | None:
    """A special token of a config file: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path, spec: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = read_input_json(path)
    except InputFileError as err:
        raise ConfigError("data.tokenizer", spec, f"{path.name} is unreadable: {err}") from None
    return data if isinstance(data, dict) else {}


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


class HfTokenizer:
    """A ``tokenizers.Tokenizer`` with Loom's document-boundary policy (see the module docstring).

    ``encode`` gives a prompt's ids (the document prefix, e.g. BOS, then the text);
    ``encode_documents`` gives whole training documents, each ending with ``eos_id``.
    """

    kind = KIND

    def __init__(self, rust: RustTokenizer, config: dict[str, Any], json_bytes: bytes,
                 config_files: dict[str, bytes] | None = None, spec: str = "") -> None:
        self._tok = rust
        self.spec = spec
        self._json_bytes = json_bytes
        self._config_files = dict(config_files or {})  # copied as they are by save()
        self.vocab_size = max(rust.get_vocab(with_added_tokens=True).values()) + 1
        self.eos_id, self.eos_token = self._special(config, "eos_token", EOS_CANDIDATES)
        self.bos_id, self.bos_token = self._special(config, "bos_token", ())
        if self.eos_id is None:
            raise ConfigError("data.tokenizer", spec, "has no end-of-sequence token to separate"
                              " documents: name one as eos_token in its tokenizer_config.json")
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if add_bos is None and add_eos is None:
            prefix, suffix = self._template()
        else:  # the configuration's flags win, as in transformers' Llama tokenizers
            if add_bos and self.bos_id is None:
                raise ConfigError("data.tokenizer", spec, "sets add_bos_token but names no"
                                  " bos_token in its vocabulary")
            prefix = [self.bos_id] if add_bos else []
            suffix = [self.eos_id] if add_eos else []
        self.prefix = np.asarray(prefix, dtype=ID_DTYPE)
        if self.bos_id is None and prefix:  # a template's BOS that no config file names
            self.bos_id = int(prefix[0])
        # one end-of-sequence token after each document, whether the template adds it or not
        self.suffix = np.asarray(suffix if suffix[-1:] == [self.eos_id] else suffix + [self.eos_id],
                                 dtype=ID_DTYPE)

    def _special(self, config: dict[str, Any], key: str,
                 fallbacks: Sequence[str]) -> tuple[int | None, str | None]:
        named = _token_content(config.get(key))
        if named is not None:
            token_id = self._tok.token_to_id(named)
            if token_id is None:
                raise ConfigError("data.tokenizer", self.spec, f"its {key} {named!r} is not in"
                                  " the vocabulary of its tokenizer.json")
            return token_id, named
        for candidate in fallbacks:
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return token_id, candidate
        return None, None

    def _template(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a single sequence."""
        bare = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        at = _find(full, bare)
        if not bare or at < 0:
            raise ConfigError("data.tokenizer", self.spec, "has a post-processor that changes"
                              " the text's ids; only templates that add tokens are supported")
        return full[:at], full[at + len(bare):]

    @functools.cached_property
    def identity(self) -> str:
        """SHA-256 of ``tokenizer.json`` and of the boundary policy: equal identities give equal
        token streams."""
        digest = hashlib.sha256(self._json_bytes)
        policy = {"prefix": self.prefix.tolist(), "suffix": self.suffix.tolist()}
        digest.update(json.dumps(policy, sort_keys=True).encode())
        return digest.hexdigest()

    # -- encoding ---------------------------------------------------------------------------------
    def _bare(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> np.ndarray:
        """The ids a prompt starts a document with: the prefix (e.g. BOS), then the text."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.concatenate([self.prefix, np.asarray(ids, dtype=ID_DTYPE)])

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Training documents: prefix, text, suffix, ending with exactly one ``eos_id`` each."""
        return [np.concatenate([self.prefix, np.asarray(ids, dtype=ID_DTYPE), self.suffix])
                for ids in self._bare(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        if hasattr(ids, "detach"):  # torch.Tensor, without importing torch here
            ids = ids.detach().cpu().numpy()
        return self._tok.decode(np.asarray(ids, dtype=np.int64).reshape(-1).tolist(),
                                skip_special_tokens=True)

    # -- files ------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """``tokenizer.json`` and the configuration files as they were, plus Loom's meta."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TOKENIZER_FILE).write_bytes(self._json_bytes)
        for name, data in self._config_files.items():
            (directory / name).write_bytes(data)
        meta = {"kind": KIND, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "identity": self.identity, "source": self.spec}
        (directory / "tokenizer_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True)
                                                       + "\n")


def _load(file: Path, spec: str) -> HfTokenizer:
    config: dict[str, Any] = {}
    copies: dict[str, bytes] = {}
    for name in (SPECIAL_TOKENS_FILE, CONFIG_FILE):  # tokenizer_config.json has the last word
        path = file.parent / name
        config.update(_read_json(path, spec))
        if path.is_file():
            copies[name] = path.read_bytes()
    try:
        json_bytes = file.read_bytes()
        rust = RustTokenizer.from_str(json_bytes.decode("utf-8"))
    except Exception as err:  # OSError, UnicodeDecodeError, or the library's plain Exception
        raise ConfigError("data.tokenizer", spec, f"{str(file)!r} is not a tokenizer.json the"
                          f" tokenizers library can read: {str(err).splitlines()[0][:200]}"
                          ) from None
    return HfTokenizer(rust, config, json_bytes, copies, spec)


@functools.lru_cache(maxsize=8)
def _load_cached(file: str, identity: tuple, spec: str) -> HfTokenizer:
    return _load(Path(file), spec)


def load_hf_tokenizer(path: str | os.PathLike[str]) -> HfTokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json`` or a directory holding one); ConfigError
    naming ``data.tokenizer`` when it is none or cannot be used. Cached per file version: config
    validation asks for the vocabulary size of every layout the planner tries."""
    spec = str(path)
    file = tokenizer_file(path) if spec.strip() else None  # "" is not the current directory
    if file is None:
        raise ConfigError("data.tokenizer", spec, "must be one of byte, bpe, or a Hugging Face"
                          " tokenizer.json (or a directory holding one); no such file")
    stamps = []
    for p in (file, file.parent / CONFIG_FILE, file.parent / SPECIAL_TOKENS_FILE):
        try:
            info = p.stat()
            stamps.append((info.st_ino, info.st_mtime_ns, info.st_size))
        except OSError:
            stamps.append(None)
    return _load_cached(str(file.resolve()), tuple(stamps), spec)

