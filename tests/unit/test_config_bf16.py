"""Config rules of ``train.dtype = bf16`` (bf16 parameters, fp32 masters): the combinations not
built yet are refused by name before anything runs; ``bf16_autocast`` (fp32 parameters) keeps
running them."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, load_config, resolve


def resolved(world: int, **overrides):
    return resolve(load_config(None, {"model.preset": "debug", **overrides}), world)


REFUSED = [  # (overrides, world, words in the message)
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "2", "train.offload_optimizer": "true"},
     2, "offload_optimizer"),
]


@pytest.mark.parametrize("overrides, world, words", REFUSED)
def test_unbuilt_combinations_are_refused_by_name(overrides, world, words):
    with pytest.raises(ConfigError) as err:
        resolved(world, **{"train.dtype": "bf16", **overrides})
    assert err.value.field_name == "train.dtype" and words in str(err.value)
    assert "bf16_autocast" in str(err.value)  # the way out
    resolved(world, **{"train.dtype": "bf16_autocast", **overrides})  # which runs them


@pytest.mark.parametrize("degrees", [{}, {"parallel.dp_shard": "2", "parallel.zero_stage": "1"},
                                     {"parallel.dp_shard": "2", "parallel.zero_stage": "3"},
                                     {"parallel.tp": "2"}, {"parallel.pp": "2"}])
def test_bf16_parameters_resolve_with_dp_zero_tp_pp(degrees):
    world = 2 if degrees else 1
    assert resolved(world, **{"train.dtype": "bf16", **degrees}).train.dtype == "bf16"


@pytest.mark.parametrize("world, degrees", [(2, {}), (4, {"parallel.dp_shard": "2",
                                                          "parallel.zero_stage": "1"}),
                                            (4, {"parallel.dp_shard": "2",
                                                 "parallel.zero_stage": "3"})])
def test_bf16_parameters_resolve_with_expert_parallelism(world, degrees):
    """Expert gradients are reduced from their fp32 ``main_grad`` (tests/dist/test_bf16_master.py
    holds ep2, ZeRO over dp_shard x ep and pp x ep to one bf16 process)."""
    config = resolved(world, **{"model.preset": "tiny-moe", "parallel.ep": "2",
                                "train.dtype": "bf16", **degrees})
    assert config.train.dtype == "bf16" and config.parallel.ep == 2


@pytest.mark.parametrize("mode", ["diloco", "noloco", "co2"])
@pytest.mark.parametrize("world, degrees", [(2, {}), (4, {"parallel.dp_shard": "2",
                                                          "parallel.zero_stage": "1"})])
def test_bf16_parameters_resolve_with_an_outer_loop(mode, world, degrees):
    """The outer loop merges the fp32 masters (tests/dist/test_outer_loop.py: bit for bit the
    fp32 arithmetic; test_outer_trainer.py: through the trainer against single processes)."""
    config = resolved(world, **{"parallel.dp_replicate": "2", "parallel.dp_mode": mode,
                                "train.dtype": "bf16", **degrees})
    assert config.train.dtype == "bf16" and config.parallel.dp_mode == mode


@pytest.mark.parametrize("method", ["int8", "topk", "powersgd"])
def test_bf16_parameters_resolve_with_gradient_compression(method):
    """The compressor reads the fp32 main_grads and keeps fp32 residuals
    (tests/dist/test_grad_compression.py: bit for bit the fp32 compressor)."""
    config = resolved(2, **{"parallel.dp_replicate": "2", "parallel.grad_compression": method,
                            "train.dtype": "bf16"})
    assert config.parallel.grad_compression == method


@pytest.mark.parametrize("degrees", [{"parallel.pp": "2"}, {"parallel.dp_replicate": "2"}])
def test_bf16_parameters_resolve_with_post_validation(degrees):
    """The post-validated step runs inside ``master_window``: its rollback is the masters'
    (tests/dist/test_post_validation.py: bit for bit the synchronous bf16 step)."""
    config = resolved(2, **{"train.post_validation": "true", "train.dtype": "bf16", **degrees})
    assert config.train.post_validation


def _state(stage: int, **overrides) -> float:
    from loom.train.memory import memory_instants

    config = resolved(4, **{"parallel.dp_shard": "4", "parallel.zero_stage": str(stage),
                            "train.global_batch_size": "8", "train.micro_batch_size": "2",
                            **overrides})
    return min(memory_instants(config), key=lambda e: e.activations).model_state


def test_the_estimator_prices_bf16_parameters_as_the_zero_paper():
    """bf16 parameters, fp32 masters at d = 4 (the allocations, measured to the byte by
    ``bench/zero_memory.py --bf16``): ZeRO-1 2Ψ + gΨ + 12Ψ/d, ZeRO-2 2Ψ + (g + 12)Ψ/d, ZeRO-3
    FSDP2's 16Ψ/d, with Ψ from fp32 ZeRO-3's 16Ψ/d."""
    psi = _state(3) * 4 / 16
    for reduce, g in (("bf16", 2), ("fp32", 4)):
        bf16 = {"train.dtype": "bf16", "train.grad_reduce_dtype": reduce}
        assert _state(1, **bf16) == pytest.approx((2 + g + 12 / 4) * psi, rel=1e-12)
        assert _state(2, **bf16) == pytest.approx((2 + (g + 12) / 4) * psi, rel=1e-12)
        assert _state(3, **bf16) == pytest.approx(16 / 4 * psi, rel=1e-12)
    autocast = {"train.dtype": "bf16_autocast"}  # fp32 parameters and gradients
    assert _state(1, **autocast) == pytest.approx((8 + 8 / 4) * psi, rel=1e-12)
