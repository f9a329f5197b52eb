"""Bytes each rank reads when ``model.init_from`` loads a Hugging Face model into a layout.

Builds a Llama (transformers' own config class, random weights, saved as safetensors, sharded
into several files), starts a ``Trainer`` with ``model.init_from`` under each layout on local
gloo ranks, and reports every rank's bytes read (``Trainer.pretrained_bytes_read``, the sizes of
the safetensors slices it requested) against the size of the weights. The ideal is 1 / (tp x pp)
for the matrices; norms are read whole by every rank that holds them.

    python bench/init_from_bytes.py          # markdown table on stdout
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from loom.config import from_dict
from loom.data.loader import prepare_data
from loom.testing.harness import PoolRegistry
from loom.testing.parity import layout_config
from loom.train.trainer import Trainer

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512)
LAYOUTS = {
    "1 process": (1, {}),
    "tp2": (2, {"tp": 2}),
    "pp2 (1f1b)": (2, {"pp": 2, "schedule": "1f1b"}),
    "dp_shard2 ZeRO-3": (2, {"dp_shard": 2, "zero_stage": 3}),
    "tp2 x pp2": (4, {"tp": 2, "pp": 2, "schedule": "1f1b"}),
    "tp2 x dp_shard2 ZeRO-3": (4, {"tp": 2, "dp_shard": 2, "zero_stage": 3}),
}


class _Data:
    source, extensions, tokenizer, bpe_vocab_size = "stdlib", (".py",), "byte", 0
    seq_len, val_fraction, max_bytes, text_field, mix = 64, 0.05, 200_000, "text", ""


def _bytes_read(ctx, table: dict, data_dir: str) -> int:
    return Trainer(from_dict(table), Path(data_dir), None, ctx).pretrained_bytes_read


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    work = Path(tempfile.mkdtemp())
    model_dir, data_dir = work / "model", work / "data"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    model.save_pretrained(model_dir, max_shard_size="2MB")  # several files and an index
    data_dir.mkdir()
    prepare_data(_Data(), data_dir)
    total = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    files = len(list(model_dir.glob("*.safetensors")))
    base = {"model.init_from": str(model_dir), "data.tokenizer": "byte", "data.seq_len": 64,
            "data.max_bytes": 200_000, "data.extensions": ".py", "train.global_batch_size": 8,
            "train.micro_batch_size": 2}
    registry = PoolRegistry()
    print(f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, fp32,"
          f" {files} safetensors files, {total / 2**20:.2f} MiB\n")
    print("| layout | ranks | bytes read per rank (share of the files) | ideal share |")
    print("|---|---|---|---|")
    try:
        for name, (world, parallel) in LAYOUTS.items():
            table = layout_config(base, world, **parallel)
            read = registry.run(world, _bytes_read, table, str(data_dir))
            ideal = 1 / (parallel.get("tp", 1) * parallel.get("pp", 1)
                         * parallel.get("dp_shard", 1))
            shares = ", ".join(f"{r / total:.3f}" for r in read)
            print(f"| {name} | {world} | {shares} | {ideal:.3f} |")
    finally:
        registry.close()


if __name__ == "__main__":
    main()
