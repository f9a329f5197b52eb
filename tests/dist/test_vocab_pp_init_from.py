"""``model.init_from`` under vocabulary parallelism across the pipeline: each rank reads its rows.

Pipeline rank r of p holds rows [rV/p, (r+1)V/p) of the embedding and the head under their full
names; ``loom.parallel.load`` reads exactly that region of each (``VocabRows`` says where). A Loom
run directory with weights no run here would initialise (seed 7) is loaded under vocab-pp at
p = 2 and 4, untied and tied: the weights gathered back (``save_weights``) are the directory's,
bit for bit. And training from it follows one process trained from it, with the pipeline parity
tolerances (tests/dist/test_pipeline_parity.py: fp32, rtol 1e-5 / atol 1e-6 on the first step,
1e-4 / 1e-5 after Adam's amplification).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom.config import from_dict
from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "train.steps": STEPS, "optim.warmup_steps": 1,
        "optim.lr": 1e-3}
VOCAB = {"parallel.vocab_parallel_pp": True, "parallel.schedule": "1f1b"}


def run_directory(root: Path, tied: bool) -> str:
    """A Loom run directory (config.toml, model.safetensors) of seed-7 weights."""
    from safetensors.torch import save_file

    from loom.config import load_config, model_args, resolve, to_toml
    from loom.models import build_model, reset_parameters

    source = root / ("tied" if tied else "untied")
    source.mkdir()
    config = resolve(load_config(None, {**BASE, "model.tie_embeddings": tied}), 1)
    (source / "config.toml").write_text(to_toml(config))
    model = build_model(model_args(config), device="cpu")
    reset_parameters(model, seed=7)  # not the seed the runs below would start from
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("output.weight")  # one tensor, saved once (as save_weights writes it)
    save_file(state, source / "model.safetensors")
    return str(source)


def saved_weights(ctx, config_table: dict, data_dir: str, out: str) -> None:
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    trainer.save_weights(Path(out))  # the full weights, the rows gathered in pp order


@pytest.mark.parametrize("pp, tied", [(2, False), (4, False), (2, True)],
                         ids=["pp2", "pp4", "pp2-tied"])
def test_each_rank_loads_its_rows_of_the_pretrained_weights(dist, small_data_dir, tmp_path, pp,
                                                            tied):
    from safetensors.torch import load_file

    source = run_directory(tmp_path, tied)
    out = tmp_path / "loaded.safetensors"
    table = layout_config({**BASE, **VOCAB, "model.init_from": source, "train.seed": 1}, pp,
                          pp=pp)
    dist.run(pp, saved_weights, table, small_data_dir, str(out))
    loaded, saved = load_file(out), load_file(Path(source) / "model.safetensors")
    assert loaded.keys() == saved.keys()
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name


def test_training_from_pretrained_weights_matches_one_process(dist, small_data_dir, tmp_path):
    source = run_directory(tmp_path, tied=False)
    base = {**BASE, "model.init_from": source, "train.seed": 1}
    reference = dist.run(1, record_training, layout_config(base, 1), small_data_dir, STEPS)[0]
    table = layout_config({**base, **VOCAB}, 2, pp=2)
    for rank, result in enumerate(dist.run(2, record_training, table, small_data_dir, STEPS)):
        label = f"vocab-pp2 from {source} rank {rank}"
        assert_parity(reference, result, rtol=1e-5, atol=1e-6, label=label, steps=range(1))
        assert_parity(reference, result, rtol=1e-4, atol=1e-5, label=label)
