"""Training data: the corpus (the stdlib's own sources by default) or dataset files
(``sources``), tokenizers (byte, BPE, Hugging Face: ``hf_tokenizer``), tokenizing once
(``prepare``), mixing sources (``mix``), packed and resumable data-parallel batches, rows of whole
documents (``packing``), token-budget microbatches of whole documents (``varlen``). See each
module's docstring for why it is shaped as it is.

The names below are imported on first use (PEP 562): the config and the planner import this
package's torch-free modules (the corpus, sources, tokenizers and batch budgets) without the
loaders, which import torch."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "BpeTokenizer": "loom.data.tokenizer",
    "ByteTokenizer": "loom.data.tokenizer",
    "DataFiles": "loom.data.loader",
    "DistributedLoader": "loom.data.loader",
    "Document": "loom.data.corpus",
    "DocumentBatch": "loom.data.packing",
    "GlobalBatchSampler": "loom.data.loader",
    "HfTokenizer": "loom.data.hf_tokenizer",
    "IGNORE_INDEX": "loom.data.packing",
    "MixSampler": "loom.data.mix",
    "MixedSequences": "loom.data.mix",
    "PACKINGS": "loom.data.packing",
    "PackedDocuments": "loom.data.packing",
    "PackedSequences": "loom.data.loader",
    "PreparedData": "loom.data.prepare",
    "Source": "loom.data.sources",
    "Tokenizer": "loom.data.tokenizer",
    "build_tokenizer": "loom.data.tokenizer",
    "eval_batches": "loom.data.loader",
    "load_documents": "loom.data.corpus",
    "load_hf_tokenizer": "loom.data.hf_tokenizer",
    "load_tokenizer": "loom.data.tokenizer",
    "parse_mix": "loom.data.mix",
    "prepare": "loom.data.prepare",
    "prepare_data": "loom.data.loader",
    "resolve_source": "loom.data.sources",
    "split_documents": "loom.data.corpus",
    "stdlib_root": "loom.data.corpus",
    "tokenizer_vocab_size": "loom.data.tokenizer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'loom.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
