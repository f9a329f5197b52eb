"""Training data: the corpus (the stdlib's own sources by default), tokenizers, packed and
resumable data-parallel batches. See each module's docstring for why it is shaped as it is."""

from loom.data.corpus import Document, load_documents, split_documents, stdlib_root
from loom.data.loader import (
    DataFiles,
    DistributedLoader,
    GlobalBatchSampler,
    PackedSequences,
    eval_batches,
    prepare_data,
)
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
    "GlobalBatchSampler",
    "PackedSequences",
    "Tokenizer",
    "build_tokenizer",
    "eval_batches",
    "load_documents",
    "load_tokenizer",
    "prepare_data",
    "split_documents",
    "stdlib_root",
    "tokenizer_vocab_size",
]
