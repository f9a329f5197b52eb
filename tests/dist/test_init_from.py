"""``model.init_from``: training starts from a Hugging Face model's weights under any layout.

Tiny random models built with ``transformers``' own config classes (a Llama 3.1 with llama3
RoPE scaling, a Qwen2 with q/k/v biases and tied embeddings) are saved as safetensors; the
first training step's loss under ``init_from`` equals the loss ``transformers`` computes on the
same tokens, for one process, and every layout (tp2, pp2 with ZB-V, ZeRO-3 on dp_shard 2, cp2)
trains exactly as that one process does. The model directory is never written to.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from loom.config import from_dict
from loom.testing.parity import assert_parity, layout_config, record_training
from loom.train.trainer import Trainer, cross_entropy
from tests.conftest import SMALL_DATA_OVERRIDES

transformers = pytest.importorskip("transformers")

STEPS = 2
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
             rms_norm_eps=1e-5)


def _llama31(path: Path) -> None:
    config = transformers.LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _qwen2(path: Path) -> None:
    config = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # transformers starts biases at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(path)


FAMILIES = {"llama3.1": _llama31, "qwen2": _qwen2}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_dir(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)
    return str(path)


def _base(hf_dir: str) -> dict:
    return {**SMALL_DATA_OVERRIDES, "model.init_from": hf_dir, "data.tokenizer": "byte",
            "train.steps": STEPS, "train.global_batch_size": 8, "train.micro_batch_size": 2,
            "optim.warmup_steps": 1, "optim.lr": 1e-3}


def _first_batch_losses(ctx, config_table: dict, data_dir: str, hf_dir: str) -> tuple:
    """Loom's loss (the trainer's own model, loaded from ``hf_dir``) and transformers' loss on
    the trainer's first batch."""
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    inputs, targets = trainer.loader.next_batch()
    with torch.no_grad():
        (stage,) = trainer.pipeline.stages.values()  # pp = 1: one stage, the whole model
        ours = cross_entropy(stage.module(inputs), targets).item()
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        theirs = cross_entropy(hf(inputs).logits, targets).item()
    return ours, theirs, trainer.pretrained_bytes_read


def _digest(path: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).iterdir())}


def test_the_first_loss_equals_transformers_on_the_same_tokens(dist, small_data_dir, hf_dir):
    config = layout_config(_base(hf_dir), 1)
    ours, theirs, read = dist.run(1, _first_batch_losses, config, small_data_dir, hf_dir)[0]
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    assert read > 0
    fresh = layout_config({k: v for k, v in _base(hf_dir).items() if k != "model.init_from"}
                          | {"model.preset": "debug"}, 1)
    random_init = dist.run(1, record_training, fresh, small_data_dir, 1)[0]["loss"][0]
    assert abs(random_init - ours) > 1e-3  # the weights did come from the directory


LAYOUTS = {
    "tp2": (2, {"tp": 2}),
    "pp2-zbv": (2, {"pp": 2, "schedule": "zbv"}),
    "dp_shard2-zero3": (2, {"dp_shard": 2, "zero_stage": 3}),
    "dp_shard2-zero1": (2, {"dp_shard": 2, "zero_stage": 1}),  # parameters: views of buckets
    "cp2": (2, {"cp": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_starts_from_the_same_weights_as_one_process(dist, small_data_dir, hf_dir,
                                                                  layout):
    before = _digest(hf_dir)
    reference = dist.run(1, record_training, layout_config(_base(hf_dir), 1), small_data_dir,
                         STEPS)[0]
    world, parallel = LAYOUTS[layout]
    config = layout_config(_base(hf_dir), world, **parallel)
    for rank, result in enumerate(dist.run(world, record_training, config, small_data_dir,
                                           STEPS)):
        assert_parity(reference, result, rtol=1e-5, atol=1e-6, label=f"{layout} rank {rank}",
                      steps=range(1))
        assert_parity(reference, result, rtol=1e-4, atol=1e-5, label=f"{layout} rank {rank}")
    assert _digest(hf_dir) == before  # nothing under the model directory was written


def _bytes_read(ctx, config_table: dict, data_dir: str) -> int:
    return Trainer(from_dict(config_table), Path(data_dir), None, ctx).pretrained_bytes_read


def test_a_tp2_pp2_rank_reads_about_a_quarter_of_the_weights(dist, small_data_dir, hf_dir):
    total = sum(p.stat().st_size for p in Path(hf_dir).glob("*.safetensors"))
    config = layout_config(_base(hf_dir), 4, pp=2, tp=2, schedule="1f1b")
    per_rank = dist.run(4, _bytes_read, config, small_data_dir)
    # each rank: its half of the layers, half of each split matrix; norms (and a tied
    # embedding, read by both ends) are whole
    assert max(per_rank) < 0.3 * total, (per_rank, total)  # measured: 0.25 of the file


def _saved_weights(ctx, config_table: dict, data_dir: str, out: str) -> None:
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    trainer.save_weights(Path(out))  # the full weights, gathered from every shard


def test_a_loom_run_directory_is_loaded_exactly_into_a_sharded_layout(dist, small_data_dir,
                                                                      tmp_path):
    from safetensors.torch import load_file, save_file

    from loom.config import load_config, model_args, resolve, to_toml
    from loom.models import build_model, reset_parameters

    source = tmp_path / "run"
    source.mkdir()
    base = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_kv_heads": 4,
            "train.global_batch_size": 8, "train.micro_batch_size": 2}
    config = resolve(load_config(None, base), 1)
    (source / "config.toml").write_text(to_toml(config))
    model = build_model(model_args(config), device="cpu")
    reset_parameters(model, seed=7)  # not the seed the runs below would start from
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              source / "model.safetensors")
    out = tmp_path / "loaded.safetensors"
    table = layout_config({**base, "model.init_from": str(source), "train.seed": 1}, 4,
                          tp=2, dp_shard=2, zero_stage=3)
    dist.run(4, _saved_weights, table, small_data_dir, str(out))
    loaded, saved = load_file(out), load_file(source / "model.safetensors")
    assert loaded.keys() == saved.keys()
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
