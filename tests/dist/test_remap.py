"""The remapping layer (``loom.parallel.remap``) over gloo, against one process.

A step of variable-length sequences is placed by the Zeppelin planner on 2 and 4 ranks (long
ones on sub-rings, zig-zag chunks, short ones whole), so ranks hold unequal tokens in a
non-contiguous order. Each rank moves its rows to the equal split, applies a per-token
function with weights (what the linear modules are), and moves the result back:

* the values on every rank equal one process's function of the full ``[T, H]`` tensor at the
  rank's global indices, and the round trip with no function is the identity (exact);
* the input gradients equal one process's at those indices, and the weight's gradient summed
  over ranks equals one process's (fp32, tight tolerance);
* the ledger counts one all-to-all per direction forward and one per direction backward, with
  exactly the rows that leave the rank as wire bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist_

from loom.data.zeppelin import Ranks, TokenCosts, plan_zeppelin
from loom.parallel.comm import CommLedger
from loom.parallel.remap import build_remap

H = 6
LENGTHS = [96, 5, 17, 3, 40, 9, 2, 11, 1, 30]  # 214 tokens, the first long enough for a ring
COSTS = TokenCosts(linear=1.0, attention=1.0, ring_intra=0.01, ring_inter=0.1)
RTOL, ATOL = 1e-6, 1e-6


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(LENGTHS), H, generator=g, dtype=torch.float32)
    w = torch.randn(H, H, generator=g, dtype=torch.float32)
    probe = torch.randn(sum(LENGTHS), H, generator=g, dtype=torch.float32)
    return x, w, probe


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * x


def _reference():
    x, w, probe = _problem()
    x, w = x.requires_grad_(), w.requires_grad_()
    y = _linear(x, w)
    (y * probe).sum().backward()
    return y.detach(), x.grad, w.grad


def remap_body(ctx, world: int):
    torch.manual_seed(0)
    group = dist_.group.WORLD
    part = plan_zeppelin(LENGTHS, Ranks(world, 2), COSTS)
    held = [part.token_indices(r) for r in range(world)]
    ledger = CommLedger()
    linear_layout = part.linear_layout()
    remap = build_remap(held, ctx.rank, group, linear_layout, ledger=ledger)
    x_full, w_full, probe = _problem()
    mine = torch.as_tensor(held[ctx.rank])
    x = x_full[mine].clone().requires_grad_()
    w = w_full.clone().requires_grad_()
    round_trip = remap.to_attention(remap.to_linear(x.detach()))
    ledger.reset()
    linear = remap.to_linear(x)
    mine_linear = torch.as_tensor(linear_layout[ctx.rank])
    linear_rows_ok = torch.equal(linear.detach(), x_full[mine_linear])
    y = remap.to_attention(_linear(linear, w))
    (y * probe[mine]).sum().backward()
    dist_.all_reduce(w.grad, group=group)
    record = ledger.get("remap", "all_to_all")
    stays = remap.send_counts[ctx.rank]
    return {"held": held[ctx.rank], "sizes": part.size, "round_trip": torch.equal(round_trip, x),
            "linear_rows": linear_rows_ok, "y": y.detach(), "x_grad": x.grad, "w_grad": w.grad,
            "calls": record.calls, "wire": record.wire_bytes,
            # each direction once forward and once backward: the rows that leave the rank
            "expected_wire": 2 * 4 * H * ((len(held[ctx.rank]) - stays)
                                          + (len(mine_linear) - stays)),
            "linear_sizes": len(mine_linear)}


@pytest.mark.parametrize("world", [2, 4])
def test_remapped_tokens_match_one_process_values_and_gradients(dist, world):
    y_ref, x_grad_ref, w_grad_ref = _reference()
    results = dist.run(world, remap_body, world)
    assert any(g > 1 for g in results[0]["sizes"])  # a sub-ring, so the layout is not trivial
    assert len({len(r["held"]) for r in results}) > 1  # unequal tokens in attention layout
    for r in results:
        index = torch.as_tensor(r["held"])
        assert r["round_trip"] and r["linear_rows"]
        torch.testing.assert_close(r["y"], y_ref[index], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["x_grad"], x_grad_ref[index], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["w_grad"], w_grad_ref, rtol=RTOL, atol=ATOL)
        assert r["linear_sizes"] in (sum(LENGTHS) // world, sum(LENGTHS) // world + 1)
        assert r["calls"] == 4  # to_linear and to_attention, forward and backward
        assert r["wire"] == pytest.approx(r["expected_wire"])


def test_a_placement_that_is_not_a_permutation_is_refused():
    with pytest.raises(ValueError, match="exactly once"):
        build_remap([np.array([0, 1]), np.array([1, 2])], 0, None)
    with pytest.raises(ValueError, match="linear_indices"):
        build_remap([np.array([0, 1]), np.array([2])], 0, None, [np.array([0]), np.array([1])])


def global_order_body(ctx, world: int):
    """The default linear layout: the equal split in global order."""
    part = plan_zeppelin(LENGTHS, Ranks(world, 2), COSTS)
    held = [part.token_indices(r) for r in range(world)]
    remap = build_remap(held, ctx.rank, dist_.group.WORLD)
    x_full = _problem()[0]
    x = x_full[torch.as_tensor(held[ctx.rank])]
    return remap.to_linear(x), remap.to_attention(remap.to_linear(x)).equal(x)


def test_the_default_linear_layout_is_the_global_order_split(dist):
    x_full = _problem()[0]
    results = dist.run(2, global_order_body, 2)
    half = sum(LENGTHS) // 2
    assert torch.equal(results[0][0], x_full[:half]) and torch.equal(results[1][0], x_full[half:])
    assert results[0][1] and results[1][1]
