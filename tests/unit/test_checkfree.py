"""CheckFree's pure part and its refusals (loom/train/checkfree.py, loom/config_rules/pipeline.py,
loom/relaunch.py): the rebuilt stage is the neighbours' gradient-norm-weighted average, bit for
bit; blocks line up by position inside the stage; layouts CheckFree cannot recover are refused by
name before anything starts."""

from __future__ import annotations

import pytest
import torch

from loom.cluster import Link, regions
from loom.config import ConfigError, load_config, model_args, resolve
from loom.launch import refuse_checkfree_launch
from loom.models.llama import Transformer
from loom.relaunch import check_recovery_layout
from loom.train.checkfree import (NORM_EPS, blocks_grad_norm, copy_target, neighbour_average,
                                  neighbour_weights, recoverable, recovery_sources,
                                  scaled_schedule, stage_blocks)
from loom.train.optim import build_scheduler


def _blocks(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"0.attention.wq.weight": torch.randn(8, 8, generator=gen),
            "0.attention_norm.weight": torch.randn(8, generator=gen),
            "1.feed_forward.w1.weight": torch.randn(16, 8, generator=gen)}


def test_average_is_the_weighted_mean_exactly_and_leaves_the_inputs_alone():
    prev, nxt = _blocks(1), _blocks(2)
    before = {k: v.clone() for k, v in prev.items()}
    w_prev, w_next = neighbour_weights(0.3, 0.9)
    assert (w_prev, w_next) == (0.3 + NORM_EPS, 0.9 + NORM_EPS)
    got = neighbour_average(prev, nxt, w_prev, w_next)
    for key in prev:
        want = (prev[key] * w_prev + nxt[key] * w_next) / (w_prev + w_next)
        assert torch.equal(got[key], want), key
        # and it is the mean the paper means: a convex combination, nearer the larger weight
        expected = prev[key].double() * (w_prev / (w_prev + w_next)) \
            + nxt[key].double() * (w_next / (w_prev + w_next))
        torch.testing.assert_close(got[key].double(), expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(prev[key], before[key])
    same = neighbour_average(prev, prev, w_prev, w_next)
    for key in prev:  # averaging a stage with itself gives the stage back
        torch.testing.assert_close(same[key], prev[key], rtol=1e-6, atol=0)


def test_average_refuses_mismatched_neighbours_and_bad_weights():
    prev, nxt = _blocks(1), _blocks(2)
    with pytest.raises(ValueError, match="different blocks"):
        neighbour_average(prev, {k: v for k, v in nxt.items() if k.startswith("0.")}, 1.0, 1.0)
    with pytest.raises(ValueError, match="8, 8"):
        neighbour_average(prev, {**nxt, "0.attention.wq.weight": torch.zeros(4, 8)}, 1.0, 1.0)
    with pytest.raises(ValueError, match="> 0"):
        neighbour_average(prev, nxt, 0.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        neighbour_weights(float("nan"), 1.0)


def test_blocks_line_up_by_position_in_the_stage_and_skip_embedding_and_head():
    config = resolve(load_config(None, {"model.preset": "debug"}), 1)
    model = Transformer(model_args(config))
    keys = set(stage_blocks(model))
    assert not any(k.startswith(("embed", "norm", "output")) for k in keys)
    assert {k.split(".", 1)[0] for k in keys} == {"0", "1", "2", "3"}
    names = dict(model.named_parameters())
    # stage made of layers 2 and 3 only: position 0 is layer 2
    slice_ = {k: v for k, v in names.items() if k.startswith(("layers.2.", "layers.3."))}
    pos = stage_blocks(slice_)
    assert pos["0.attention.wq.weight"] is names["layers.2.attention.wq.weight"]
    assert pos["1.attention.wq.weight"] is names["layers.3.attention.wq.weight"]
    assert blocks_grad_norm(model) == 0.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    block_elems = sum(v.numel() for v in stage_blocks(model).values())
    assert blocks_grad_norm(model) == pytest.approx(block_elems ** 0.5, rel=1e-6)


@pytest.mark.parametrize("overrides, world, field", [
    ({"fault.recovery": "checkfree", "parallel.pp": "2"}, 2, "fault.recovery"),
    ({"fault.recovery": "checkfree_plus", "parallel.pp": "3"}, 3, "fault.recovery"),
    ({"fault.recovery": "checkfree_plus", "parallel.pp": "4", "model.tie_embeddings": "true"}, 4,
     "model.tie_embeddings"),
    ({"fault.recovery": "checkfree_plus", "parallel.pp": "4", "data.packing": "pack"}, 4,
     "data.packing"),
    ({"fault.recovery": "checkfree_plus", "parallel.pp": "4", "fault.test_kill_stages": "0,4"},
     4, "fault.test_kill_stages"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stages": "0"}, 4,
     "fault.test_kill_stages"),
    ({"fault.recovery": "checkfree_plus", "parallel.pp": "4", "fault.test_kill_stages": "0",
      "fault.test_kill_stage": "1"}, 4, "fault.test_kill_stages"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.recovery_lr_scale": "0"}, 4,
     "fault.recovery_lr_scale"),
    ({"fault.test_kill_stages": "1", "parallel.pp": "4"}, 4, "fault.test_kill_stages"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "parallel.tp": "2"}, 8, "parallel.tp"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "parallel.dp_shard": "2"}, 8,
     "parallel.dp_shard"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "parallel.schedule": "zb_h1"}, 4,
     "parallel.schedule"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stage": "3"}, 4,
     "fault.test_kill_stage"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stage": "1",
      "fault.test_kill_step": "0"}, 4, "fault.test_kill_step"),
    ({"fault.test_kill_stage": "1", "parallel.pp": "4"}, 4, "fault.test_kill_stage"),
    ({"fault.test_kill_steps": "3", "parallel.pp": "4"}, 4, "fault.test_kill_steps"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stages": "1,2",
      "fault.test_kill_steps": "3"}, 4, "fault.test_kill_steps"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stages": "1,2",
      "fault.test_kill_steps": "5,3"}, 4, "fault.test_kill_steps"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stages": "1,2",
      "fault.test_kill_steps": "3,3"}, 4, "fault.test_kill_steps"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stages": "1",
      "fault.test_kill_steps": "0"}, 4, "fault.test_kill_steps"),
    ({"fault.recovery": "checkfree", "parallel.pp": "4", "fault.test_kill_stages": "1",
      "fault.test_kill_steps": "3", "fault.test_kill_step": "2"}, 4, "fault.test_kill_steps"),
])
def test_layouts_checkfree_cannot_recover_are_refused_by_name(overrides, world, field):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, {"model.n_layers": "8", **overrides}), world)
    assert err.value.field_name == field


def test_a_partition_with_unequal_stages_is_refused_before_launch():
    ok = resolve(load_config(None, {"fault.recovery": "checkfree", "parallel.pp": "4",
                                    "model.preset": "tiny"}), 4)
    check_recovery_layout(ok)  # 4 layers over 4 stages: one block each
    uneven = resolve(load_config(None, {"fault.recovery": "checkfree", "parallel.pp": "3",
                                        "model.preset": "tiny"}), 3)
    with pytest.raises(ConfigError) as err:
        check_recovery_layout(uneven)
    assert err.value.field_name == "fault.recovery" and "same number of blocks" in str(err.value)


def test_launches_checkfree_cannot_run_are_refused_before_anything_is_written(monkeypatch):
    config = resolve(load_config(None, {"fault.recovery": "checkfree", "parallel.pp": "4",
                                        "model.preset": "tiny"}), 4)
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    refuse_checkfree_launch(config, 0, None)
    with pytest.raises(ConfigError) as err:
        refuse_checkfree_launch(config, 1, None)
    assert err.value.field_name == "--max-restarts"
    with pytest.raises(ConfigError) as err:
        refuse_checkfree_launch(config, 0, regions([4], intra=Link(0, 1e9), inter=Link(0, 1e9)))
    assert err.value.field_name == "--emulate"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ConfigError) as err:
        refuse_checkfree_launch(config, 0, None)
    assert err.value.field_name == "fault.recovery" and "torchrun" in str(err.value)


def test_which_stages_each_mode_rebuilds_and_from_what():
    assert [recoverable("checkfree", s, 4) for s in range(4)] == [False, True, True, False]
    assert all(recoverable("checkfree_plus", s, 4) for s in range(4))
    assert not recoverable("checkpoint", 1, 4)
    # a middle stage: both neighbours (averaged); the ends under checkfree_plus: the one neighbour
    assert recovery_sources("checkfree", 2, 5) == (1, 3)
    assert recovery_sources("checkfree_plus", 2, 5) == (1, 3)
    assert recovery_sources("checkfree_plus", 0, 5) == (1,)
    assert recovery_sources("checkfree_plus", 4, 5) == (3,)
    with pytest.raises(ValueError, match=r"cannot rebuild stage 0 of 4 .*checkfree_plus"):
        recovery_sources("checkfree", 0, 4)
    # the ends' copies live on the neighbours; middle stages copy nothing
    assert copy_target(0, 4) == (1, ("tok_embeddings.weight",))
    assert copy_target(3, 4) == (2, ("norm.weight", "output.weight"))
    assert copy_target(1, 4) is None and copy_target(2, 4) is None


def _scheduler(lr: float):
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW(params, lr=lr)
    return build_scheduler(optimizer, total_steps=20, warmup_steps=5, min_ratio=0.1)


def test_the_rebuilt_schedule_continues_at_the_neighbours_step_scaled_once():
    neighbour = _scheduler(1e-3)
    for _ in range(7):
        neighbour.optimizer.step()
        neighbour.step()
    fresh = _scheduler(1e-3)
    state = scaled_schedule(fresh.state_dict(), neighbour.state_dict(), 1.1)
    assert state["last_epoch"] == neighbour.last_epoch == 7
    assert state["base_lrs"] == [1e-3 * 1.1]
    fresh.load_state_dict(state)
    fresh.optimizer.step()
    fresh.step()
    neighbour.optimizer.step()
    neighbour.step()
    # one step later both follow the schedule, the rebuilt one 1.1x higher
    assert fresh.get_last_lr()[0] == pytest.approx(1.1 * neighbour.get_last_lr()[0], rel=1e-12)
    # a neighbour that was itself rebuilt (scaled) does not pass its scale on: the base rates
    # are the receiver's own
    again = scaled_schedule(_scheduler(1e-3).state_dict(), fresh.state_dict(), 1.1)
    assert again["base_lrs"] == [1e-3 * 1.1] and again["last_epoch"] == 8
    with pytest.raises(ValueError, match="finite and > 0"):
        scaled_schedule(fresh.state_dict(), neighbour.state_dict(), 0.0)
