"""``train.fp8``: which recipes, devices and layouts the config accepts, and which layers
convert (loom/parallel/fp8.py)."""

import pytest
import torch

from loom.config import ConfigError, load_config, resolve
from loom.models.llama import Transformer
from loom.models.presets import PRESETS
from loom.cli import main
from loom.parallel.fp8 import apply_fp8, converts, device_refusal, torchao_available

needs_torchao = pytest.mark.skipif(not torchao_available(), reason="needs torchao (loom[fp8])")


def resolved(world: int = 1, **overrides):
    table = {"model.preset": "debug", "train.device": "cpu", **overrides}
    return resolve(load_config(None, table), world)


def refusal(world: int = 1, **overrides) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        resolved(world, **overrides)
    return err.value


def test_an_unknown_recipe_is_refused_with_the_nearest_name():
    err = refusal(**{"train.fp8": "rowise"})
    assert err.field_name == "train.fp8" and "rowwise" in str(err)


@needs_torchao
def test_loom_train_refuses_fp8_on_a_cpu_unless_emulated(tmp_path, capsys):
    """The device is the machine's, not the config's: the planner writes FP8 configs for GPUs
    it is not on, so ``loom train`` asks, before anything is written or started."""
    cpu = torch.device("cpu")
    assert "'cpu' has no FP8 matmuls" in device_refusal("tensorwise", False, cpu)
    assert device_refusal("tensorwise", True, cpu) is None
    assert device_refusal("none", False, cpu) is None
    run_dir = tmp_path / "run"
    code = main(["train", "--train.device=cpu", "--train.fp8=tensorwise", "--train.steps=1",
                 f"--train.run_dir={run_dir}", "--dry-run"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "train.fp8" in line and "'cpu' has no FP8 matmuls" in line
    assert "fp8_emulate" in line and "\n" not in line
    assert not run_dir.exists()


def test_emulation_without_a_recipe_is_refused():
    assert refusal(**{"train.fp8_emulate": True}).field_name == "train.fp8_emulate"


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_tensor_and_sequence_parallelism_take_every_recipe(recipe):
    config = resolved(2, **{"train.fp8": recipe, "train.fp8_emulate": True, "parallel.tp": 2,
                            "parallel.sequence_parallel": True})
    assert config.parallel.tp == 2 and config.train.fp8 == recipe


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_context_parallelism_takes_only_the_per_token_recipe(recipe):
    err = refusal(2, **{"train.fp8": recipe, "train.fp8_emulate": True, "parallel.cp": 2})
    assert err.field_name == "train.fp8" and "rowwise_with_gw_hp" in str(err)
    assert resolved(2, **{"train.fp8": "rowwise_with_gw_hp", "train.fp8_emulate": True,
                          "parallel.cp": 2}).parallel.cp == 2


@needs_torchao
def test_the_float8_all_gather_takes_tensorwise_under_zero3_only():
    """``train.fp8_all_gather`` is ZeRO-3's (FSDP2's) gather of the weights cast with one scale
    per tensor: torchao builds it for tensorwise only, and without sharded weights there is no
    gather (TorchTitan's rule: dp_shard > 1)."""
    zero3 = {"train.fp8": "tensorwise", "train.fp8_emulate": True, "train.fp8_all_gather": True,
             "parallel.dp_shard": 2, "parallel.zero_stage": 3}
    assert resolved(2, **zero3).train.fp8_all_gather
    cases = [(2, {"train.fp8": "rowwise"}, "tensorwise"),
             (2, {"train.fp8": "none", "train.fp8_emulate": False}, "tensorwise"),
             (2, {"parallel.zero_stage": 1}, "zero_stage = 3"),
             (2, {"parallel.dp_shard": 1, "parallel.dp_replicate": 2}, "dp_shard > 1"),
             (4, {"parallel.tp": 2}, "tp = 2"),
             (2, {"train.offload_optimizer": True}, "offload_optimizer")]
    for world, change, rule in cases:
        err = refusal(world, **{**zero3, **change})
        assert err.field_name == "train.fp8_all_gather" and rule in str(err), (change, err)


def test_the_blocks_linears_convert_but_not_the_head_the_router_or_odd_shapes():
    model = Transformer(PRESETS["tiny-moe"])
    chosen = {name for name, module in model.named_modules() if converts(name, module)}
    assert "layers.0.attention.wq" in chosen and "layers.0.feed_forward.w2" in chosen
    assert "layers.1.feed_forward.shared.w1" in chosen
    assert "output" not in chosen
    assert not [name for name in chosen if name.endswith("router")]
    odd = torch.nn.Linear(64, 24)  # 24 is not a multiple of 16: no FP8 GEMM for it
    assert not converts("layers.0.attention.wk", odd)


@needs_torchao
def test_converted_layers_keep_their_parameters_and_names():
    model = Transformer(PRESETS["debug"])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    count = apply_fp8(model, "tensorwise", emulate=True)
    assert count == sum(1 for name, m in model.named_modules() if type(m).__name__ ==
                        "Float8Linear")
    assert count == 7 * PRESETS["debug"].n_layers
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    assert all(torch.equal(after[name], value) for name, value in before.items())
