"""Training data: the corpus (the stdlib's own sources by default) or dataset files
(``sources``), tokenizers (byte, BPE, Hugging Face: ``hf_tokenizer``), tokenizing once
(``prepare``), mixing sources (``mix``), packed and resumable data-parallel batches, rows of whole
documents (``packing``), token-budget microbatches of whole documents (``varlen``). See each
module's docstring for why it is shaped as it is."""

from loom.data.corpus import Document, load_documents, split_documents, stdlib_root
from loom.data.hf_tokenizer import HfTokenizer, load_hf_tokenizer
from loom.data.loader import (
    DataFiles,
    DistributedLoader,
    GlobalBatchSampler,
    PackedSequences,
    eval_batches,
    prepare_data,
)
from loom.data.mix import MixedSequences, MixSampler, parse_mix
from loom.data.packing import IGNORE_INDEX, PACKINGS, DocumentBatch, PackedDocuments
from loom.data.prepare import PreparedData, prepare
from loom.data.sources import Source, resolve_source
from loom.data.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    tokenizer_vocab_size,
)

__all__ = [
    "BpeTokenizer",
    "ByteTokenizer",
    "DataFiles",
    "DistributedLoader",
    "Document",
    "DocumentBatch",
    "GlobalBatchSampler",
    "HfTokenizer",
    "IGNORE_INDEX",
    "MixSampler",
    "MixedSequences",
    "PACKINGS",
    "PackedDocuments",
    "PackedSequences",
    "PreparedData",
    "Source",
    "Tokenizer",
    "build_tokenizer",
    "eval_batches",
    "load_documents",
    "load_hf_tokenizer",
    "load_tokenizer",
    "parse_mix",
    "prepare",
    "prepare_data",
    "resolve_source",
    "split_documents",
    "stdlib_root",
    "tokenizer_vocab_size",
]
