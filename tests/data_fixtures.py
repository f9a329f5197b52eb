"""Tiny tokenizers and datasets built on the spot, for the data tests (nothing is downloaded).

``make_tokenizer`` trains a byte-level BPE with the ``tokenizers`` library on ``TEXTS`` (a fraction
of a second) and writes ``tokenizer.json``, optionally with a BOS template in its post-processor and
a ``tokenizer_config.json``. ``write_source`` writes the same documents as a text directory (one
file per document, sorted in document order), JSON lines, Parquet, Arrow or a ``datasets``
``save_to_disk`` directory.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from loom.data.loader import prepare_data

BOS, EOS = "<s>", "</s>"

TEXTS = [f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. héllo wörld 🙂\n"
         + "def f(x):\n    return x * %d\n" % i + ("lorem ipsum dolor sit amet " * (i % 5))
         for i in range(40)]


def make_tokenizer(directory: Path, *, vocab_size: int = 400, bos_template: bool = False,
                   config: dict[str, Any] | None = None, special_map: dict[str, Any] | None = None,
                   eos: str = EOS, texts: Sequence[str] = TEXTS) -> Path:
    """A trained byte-level BPE in ``directory``; returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, eos, "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    if bos_template:  # as Llama 3's tokenizer.json: the post-processor puts BOS first
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    return path


def write_source(path: Path, kind: str, texts: Sequence[str] = TEXTS, field: str = "text",
                 extra: bool = True) -> Path:
    """``texts`` as a source of ``kind``: text (directory), jsonl, parquet, arrow or saved."""
    rows = [{field: t, "id": i} if extra else {field: t} for i, t in enumerate(texts)]
    if kind == "text":
        path.mkdir(parents=True, exist_ok=True)
        for i, t in enumerate(texts):
            (path / f"{i:05d}.txt").write_text(t, encoding="utf-8")
        return path
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    if kind == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif kind == "arrow":
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
    elif kind == "saved":
        import datasets

        datasets.disable_progress_bars()
        datasets.Dataset(table).save_to_disk(str(path))
    else:
        raise ValueError(kind)
    return path


@dataclass
class DataCfg:  # the attributes of loom.config.DataConfig (duck-typed on purpose)
    source: str = "stdlib"
    extensions: tuple[str, ...] = (".py", ".txt", ".md")
    tokenizer: str = "byte"
    bpe_vocab_size: int = 2048
    seq_len: int = 16
    val_fraction: float = 0.1
    max_bytes: int = 0
    text_field: str = "text"
    mix: str = ""


def write_short_documents(directory: Path, count: int, seed: int) -> None:
    """``count`` text files of very different lengths in ``directory``: mostly 3 to 30 bytes
    (log-uniform), one in ten 40 to 120 (split over rows at short sequence lengths), so packed
    rows hold several documents and end in padding."""
    rng = random.Random(seed)
    for i in range(count):
        length = int(3 * 10 ** rng.random()) if rng.random() < 0.9 else rng.randint(40, 120)
        text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(length))
        (directory / f"doc{i:04d}.txt").write_text(text)


def prepared_documents(tmp_path_factory: Any, name: str, seq_len: int, *, count: int, seed: int,
                       write: Callable[[Path, int, int], None] = write_short_documents
                       ) -> tuple[str, dict[str, Any]]:
    """A prepared data directory of ``write``'s documents (``count`` files, ``seed``) and the
    overrides every document parity test starts from: the source, ``seq_len``, one warm-up step,
    lr 1e-3, clipping at 1, no evaluation."""
    source = tmp_path_factory.mktemp(name)
    write(source, count, seed)
    out = tmp_path_factory.mktemp(f"{name}_data")
    prepare_data(DataCfg(source=str(source), extensions=(".txt",), seq_len=seq_len,
                         val_fraction=0.1), out)
    overrides = {"data.source": str(source), "data.extensions": ".txt", "data.seq_len": seq_len,
                 "data.val_fraction": 0.1, "optim.warmup_steps": 1, "optim.lr": 1e-3,
                 "train.grad_clip": 1.0, "train.eval_every": 0}
    return str(out), overrides
