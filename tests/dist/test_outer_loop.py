"""Outer-loop data parallelism (``loom.parallel.outer``) on gloo ranks, against references that
simulate the replicas on one process.

Every test runs on the shared 4-rank pool. The replicas' inner steps are deterministic stand-ins
(``inner_update``: each replica moves its weights by its own seeded noise), except in the DiLoCo
H = 1 tests, which train a small linear model with real AdamW / SGD steps. The references are
written out here from the papers' update rules, independently of the module's code (they share
only NoLoCo's pairing schedule, which ``test_noloco_schedule_*`` checks on its own).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from loom.formulas.outer import replica_link_cost
from loom.parallel.comm import CommLedger
from loom.parallel.outer import OuterLoop, noloco_pairs

WORLD = 4
SHAPES = {"w1": (4, 3), "b1": (4,), "w2": (2, 4)}  # 24 parameters
P = 24
# fp32 throughout; the module and the references sum in different orders (gloo's ring vs. a
# Python sum), so they agree to rounding, a few ulps of values of order 1.
RTOL, ATOL = 1e-6, 1e-6


def initial_params() -> dict[str, torch.Tensor]:
    """The same weights on every replica."""
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def inner_update(replica: int, step: int, index: int, shape) -> torch.Tensor:
    """What replica ``replica``'s inner step ``step`` subtracts from parameter ``index``."""
    gen = torch.Generator().manual_seed(10_000 * replica + 100 * step + index)
    return 0.01 * torch.randn(shape, generator=gen)


def _group(ranks: list[int] | None):
    """The world, or a subgroup (created on every rank, as torch requires)."""
    if ranks is None:
        return torch_dist.group.WORLD
    return torch_dist.new_group(ranks)


def run_outer(ctx, mode: str, steps: int, options: dict, ranks: list[int] | None = None):
    """Inner stand-in steps and the outer loop on this rank; its final weights and ledger."""
    group = _group(ranks)
    if ranks is not None and ctx.rank not in ranks:
        return None
    replica = torch_dist.get_rank(group)
    params = {name: nn.Parameter(t) for name, t in initial_params().items()}
    ledger = CommLedger()
    loop = OuterLoop(params.items(), group, mode=mode, ledger=ledger, **options)
    took = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for index, p in enumerate(params.values()):
                p.sub_(inner_update(replica, step, index, p.shape))
        took.append(loop.after_inner_step(step))
    loop.finish()
    return {"params": {n: p.detach().clone() for n, p in params.items()},
            "ledger": {key: (r.calls, r.payload_bytes, r.wire_bytes)
                       for key, r in ledger.records.items()},
            "took": took}


# -- the references ----------------------------------------------------------------------------
def _nesterov(g, m, mu, lr, nesterov):
    """torch's SGD(momentum=mu, nesterov=...) on one tensor: returns (update to subtract, m)."""
    m = mu * m + g
    return lr * (g + mu * m if nesterov else m), m


def reference(mode: str, replicas: int, steps: int, *, outer_steps: int, outer_lr: float,
              outer_momentum: float = 0.9, nesterov: bool | None = None, seed: int = 0,
              fragments: int = 1, noloco_consensus: float = 1.0, co2_gap_penalty: float = 1.0,
              co2_clip: float | None = None, bucket_bytes: int | None = None):
    """R replicas on one process; returns every replica's weights and what was exercised."""
    if nesterov is None:  # the papers' forms: DiLoCo Nesterov, NoLoCo and CO2 heavy ball
        nesterov = mode == "diloco"
    names = list(SHAPES)
    init = initial_params()
    theta = [{n: init[n].clone() for n in names} for _ in range(replicas)]
    mu, lr, H = outer_momentum, outer_lr, outer_steps
    seen = {"clipped": 0, "penalised": 0, "alone": 0}
    # diloco / co2: one shared outer state; noloco: each replica its own
    phi = {n: init[n].clone() for n in names}
    m = {n: torch.zeros_like(init[n]) for n in names}
    phis = [{n: init[n].clone() for n in names} for _ in range(replicas)]
    ms = [{n: torch.zeros_like(init[n]) for n in names} for _ in range(replicas)]
    displacement = {n: torch.zeros_like(init[n]) for n in names}
    pending = None
    outer_index = 0
    # streaming: contiguous halves by element count (w1: 12 | b1, w2: 4 + 8); fragment 0 syncs
    # at the steps s with s % H == H/2, fragment 1 at the multiples of H.
    fragment_of = {"w1": 0, "b1": 1, "w2": 1} if fragments == 2 else {n: 0 for n in names}
    assert fragments in (1, 2)
    for step in range(1, steps + 1):
        for r in range(replicas):
            for index, n in enumerate(names):
                theta[r][n] -= inner_update(r, step, index, SHAPES[n])
        if mode == "diloco":
            due = [f for f in range(fragments)
                   if step % H == ((H // 2) if (fragments == 2 and f == 0) else 0)]
            for n in names:
                if fragment_of[n] not in due:
                    continue
                g = sum(phi[n] - theta[r][n] for r in range(replicas)) / replicas
                update, m[n] = _nesterov(g, m[n], mu, lr, nesterov)
                phi[n] = phi[n] - update
                for r in range(replicas):
                    theta[r][n] = phi[n].clone()
        elif step % H == 0 and mode == "noloco":
            pairs, alone = noloco_pairs(replicas, seed, outer_index)
            peer_of = {a: b for a, b in pairs} | {b: a for a, b in pairs}
            grads = {}
            for r in range(replicas):
                p = peer_of.get(r)
                if p is None:
                    seen["alone"] += 1
                    grads[r] = {n: phis[r][n] - theta[r][n] for n in names}
                    continue
                grads[r] = {n: ((phis[r][n] - theta[r][n]) + (phis[p][n] - theta[p][n])) / 2
                            + noloco_consensus * (phis[r][n] - (phis[r][n] + phis[p][n]) / 2)
                            for n in names}
            for r in range(replicas):
                for n in names:
                    update, ms[r][n] = _nesterov(grads[r][n], ms[r][n], mu, lr, nesterov)
                    phis[r][n] = phis[r][n] - update
                    theta[r][n] = phis[r][n].clone()
            outer_index += 1
        elif step % H == 0 and mode == "co2":
            fresh = {n: sum(phi[n] - theta[r][n] for r in range(replicas)) / replicas
                     for n in names}
            for n in names:
                if pending is not None:
                    penalty = 1.0
                    if co2_gap_penalty:
                        penalty = 1 + co2_gap_penalty * displacement[n].norm() \
                            / max(pending[n].norm(), torch.tensor(1e-12))
                        seen["penalised"] += int(penalty > 1)
                    g = pending[n] / penalty
                    m[n] = mu * m[n] + g
                    if co2_clip is not None:
                        seen["clipped"] += int((m[n].abs() > co2_clip).sum())
                        m[n] = m[n].clamp(-co2_clip, co2_clip)
                    update = lr * (g + mu * m[n] if nesterov else m[n])
                    new = phi[n] - update
                    displacement[n] = new - phi[n]
                    phi[n] = new
                for r in range(replicas):
                    theta[r][n] = phi[n].clone()
            pending = fresh
    return theta, seen


# -- the schedule ------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [2, 3, 4, 7, 8])
def test_noloco_schedule_pairs_every_replica_once_reproducibly(replicas):
    schedules = [noloco_pairs(replicas, seed=5, outer_step=k) for k in range(20)]
    for pairs, alone in schedules:
        members = [r for pair in pairs for r in pair] + ([alone] if alone is not None else [])
        assert sorted(members) == list(range(replicas))  # each replica exactly once
        assert (alone is None) == (replicas % 2 == 0)
    assert schedules == [noloco_pairs(replicas, seed=5, outer_step=k) for k in range(20)]
    if replicas >= 4:  # the pairing changes from step to step and with the seed
        assert len({frozenset(map(frozenset, pairs)) for pairs, _ in schedules}) > 1
        assert schedules != [noloco_pairs(replicas, seed=6, outer_step=k) for k in range(20)]
    if replicas % 2:  # the one left out rotates
        assert len({alone for _, alone in schedules}) > 1


# -- (1) DiLoCo with H = 1, outer lr 1, no momentum ---------------------------------------------
def _data(replica: int, step: int):
    gen = torch.Generator().manual_seed(777 + 31 * replica + step)
    x = torch.randn(8, 3, generator=gen)
    return x, x @ torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]]) + 0.1


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _optimizer(inner: str, params):
    if inner == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1)


def train_diloco_h1(ctx, inner: str, steps: int):
    model = _linear()
    optimizer = _optimizer(inner, model.parameters())
    loop = OuterLoop(model.named_parameters(), torch_dist.group.WORLD, mode="diloco",
                     outer_steps=1, outer_lr=1.0, outer_momentum=0.0)
    for step in range(1, steps + 1):
        x, y = _data(ctx.rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        loop.after_inner_step(step)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _averaged_replicas(inner: str, steps: int) -> dict[str, torch.Tensor]:
    """Each replica takes its own optimizer step, then every replica's weights become the mean."""
    models = [_linear() for _ in range(WORLD)]
    optimizers = [_optimizer(inner, m.parameters()) for m in models]
    for step in range(1, steps + 1):
        for r, (model, optimizer) in enumerate(zip(models, optimizers)):
            x, y = _data(r, step)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            for params in zip(*(m.parameters() for m in models)):
                mean = sum(params) / WORLD
                for p in params:
                    p.copy_(mean)
    return {n: p.detach() for n, p in models[0].named_parameters()}


def _synchronous_dp(inner: str, steps: int) -> dict[str, torch.Tensor]:
    """One model, gradients averaged over the replicas' batches before each optimizer step."""
    model = _linear()
    optimizer = _optimizer(inner, model.parameters())
    for step in range(1, steps + 1):
        for r in range(WORLD):
            x, y = _data(r, step)
            (nn.functional.mse_loss(model(x), y) / WORLD).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_diloco_h1_averages_the_weights_after_each_adamw_step(dist):
    """DiLoCo with H = 1, outer lr 1 and no momentum is parameter averaging after every inner
    step. With AdamW that is not synchronous data parallelism (AdamW is not linear in the
    gradient), which the last assertion shows, so the reference is the averaging itself."""
    steps = 5
    results = dist.run(WORLD, train_diloco_h1, "adamw", steps)
    expected = _averaged_replicas("adamw", steps)
    for rank, params in enumerate(results):
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    sync = _synchronous_dp("adamw", steps)
    assert max((results[0][n] - sync[n]).abs().max() for n in sync) > 1e-3


def test_diloco_h1_with_sgd_inner_steps_is_synchronous_data_parallelism(dist):
    """With a plain SGD inner step, the mean of the replicas' steps is the step of the mean
    gradient, so DiLoCo H = 1, outer lr 1, no momentum equals synchronous data parallelism."""
    steps = 5
    results = dist.run(WORLD, train_diloco_h1, "sgd", steps)
    expected = _synchronous_dp("sgd", steps)
    for rank, params in enumerate(results):
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# -- (2) NoLoCo with every replica paired and full averaging ------------------------------------
FULL_AVERAGING = dict(outer_steps=1, outer_lr=1.0, outer_momentum=0.0, noloco_consensus=1.0,
                      seed=3)


def _after_one_inner_step(replica: int) -> dict[str, torch.Tensor]:
    return {n: t - inner_update(replica, 1, index, t.shape)
            for index, (n, t) in enumerate(initial_params().items())}


@pytest.mark.parametrize("replicas", [2, 4])
def test_noloco_full_averaging_is_one_pairwise_averaging_step(dist, replicas):
    ranks = None if replicas == WORLD else list(range(replicas))
    results = dist.run(WORLD, run_outer, "noloco", 1, FULL_AVERAGING, ranks)[:replicas]
    pairs, alone = noloco_pairs(replicas, FULL_AVERAGING["seed"], 0)
    assert alone is None and len(pairs) == replicas // 2  # every replica paired
    for a, b in pairs:
        before_a, before_b = _after_one_inner_step(a), _after_one_inner_step(b)
        for name in SHAPES:
            mean = (before_a[name] + before_b[name]) / 2
            for r in (a, b):
                torch.testing.assert_close(results[r]["params"][name], mean, rtol=RTOL,
                                           atol=ATOL, msg=lambda m: f"replica {r} {name}: {m}")
    if replicas == 4:  # a pairwise step, not a global average: the two pairs still differ
        (a, _), (c, _) = pairs
        assert (results[a]["params"]["w1"] - results[c]["params"]["w1"]).abs().max() > 1e-4
        assert all(set(r["ledger"]) == {("dp_replicate", "send"), ("dp_replicate", "recv")}
                   for r in results)


# -- (3) the outer update against the hand-computed references ----------------------------------
CASES = {
    "diloco": ("diloco", None, 8, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)),
    "diloco-buckets": ("diloco", None, 6, dict(outer_steps=3, outer_lr=0.7, outer_momentum=0.9,
                                               bucket_bytes=16)),
    "diloco-heavy-ball": ("diloco", None, 6, dict(outer_steps=2, outer_lr=0.5,
                                                  outer_momentum=0.8, nesterov=False)),
    "diloco-streaming": ("diloco", None, 12, dict(outer_steps=4, outer_lr=0.7,
                                                  outer_momentum=0.9, fragments=2)),
    "noloco": ("noloco", None, 8, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.5,
                                       seed=11)),
    "noloco-partial-consensus": ("noloco", None, 8, dict(outer_steps=2, outer_lr=0.7,
                                                         outer_momentum=0.5, seed=11,
                                                         noloco_consensus=0.5)),
    "noloco-odd": ("noloco", [0, 1, 2], 8, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.5,
                                                seed=2)),
    "co2": ("co2", None, 10, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.5,
                                  co2_gap_penalty=1.0, co2_clip=0.01)),
    "co2-no-penalty": ("co2", None, 8, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9,
                                            co2_gap_penalty=0.0)),
    "co2-nesterov": ("co2", None, 8, dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.5,
                                          nesterov=True, co2_clip=0.01)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outer_update_matches_the_reference(dist, case):
    mode, ranks, steps, options = CASES[case]
    replicas = WORLD if ranks is None else len(ranks)
    results = dist.run(WORLD, run_outer, mode, steps, options, ranks)[:replicas]
    expected, seen = reference(mode, replicas, steps, **options)
    for r in range(replicas):
        for name in SHAPES:
            torch.testing.assert_close(results[r]["params"][name], expected[r][name], rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"replica {r} {name}: {m}")
    # the cases exercise what they are named for
    moved = (results[0]["params"]["w1"] - initial_params()["w1"]).abs().max()
    assert moved > 0.01
    if mode == "co2" and options.get("co2_clip"):
        assert seen["clipped"] > 0 and seen["penalised"] > 0
    if case == "noloco-odd":
        assert seen["alone"] == steps // options["outer_steps"]
    if mode in ("diloco", "co2"):  # one outer state: replicas identical after it was applied
        # (every case ends on an outer step of w2's fragment; streaming's w1 synced 2 steps ago)
        assert all(torch.equal(results[r]["params"]["w2"], results[0]["params"]["w2"])
                   for r in range(replicas))


# -- CO2, one outer step worked out by hand ---------------------------------------------------------
# Two elements, 4 replicas, H = 1, lr 0.5, mu 0.5, lambda 1, clip 0.4, heavy ball (CO2's update):
#   step 1: mean step a1 = (0.3, 0.9); nothing stale yet, so x stays at x0 = (1, 1), a1 in flight.
#   step 2: stale a1 lands; gap x_{1,0} - x_{0,0} = 0, so Lambda = 1;
#           m = clip(0.5 * 0 + a1, 0.4) = (0.3, 0.4);  x = x0 - 0.5 m = (0.85, 0.8).
#   step 3: stale a2 = (0.2, -0.15) lands (|a2| = 0.25); gap = -0.5 m = (-0.15, -0.2), |gap| = 0.25,
#           so Lambda = 1 + 1 * 0.25 / 0.25 = 2;  m = clip(0.5 (0.3, 0.4) + a2 / 2, 0.4)
#           = (0.15 + 0.1, 0.2 - 0.075) = (0.25, 0.125);  x = (0.85, 0.8) - 0.5 m = (0.725, 0.7375).
# Nesterov instead would have stepped by lr (g + mu m) at step 2: x = x0 - 0.5 (0.3 + 0.15, 0.4 + 0.2)
# = (0.775, 0.7), which the test also rules out.
MEAN_STEPS = {1: (0.3, 0.9), 2: (0.2, -0.15), 3: (-1.0, 2.0)}  # step 3's is in flight at the end
SPREAD = (0.125, -0.125, 0.25, -0.25)  # each replica's own deviation; they sum to zero


def co2_by_hand(ctx, steps: int):
    x = nn.Parameter(torch.ones(2))
    loop = OuterLoop([("x", x)], torch_dist.group.WORLD, mode="co2", outer_steps=1, outer_lr=0.5,
                     outer_momentum=0.5, co2_gap_penalty=1.0, co2_clip=0.4)
    after = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            x.sub_(torch.tensor(MEAN_STEPS[step]) + SPREAD[ctx.rank])
        loop.after_inner_step(step)
        after.append(x.detach().clone())
    loop.finish()
    return after


def test_co2_outer_steps_equal_the_paper_update_worked_by_hand(dist):
    results = dist.run(WORLD, co2_by_hand, 3)
    expected = [torch.tensor([1.0, 1.0]), torch.tensor([0.85, 0.8]),
                torch.tensor([0.725, 0.7375])]
    for rank, after in enumerate(results):
        for step, (got, want) in enumerate(zip(after, expected), start=1):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"replica {rank} after step {step}: {m}")
    assert not torch.allclose(results[0][1], torch.tensor([0.775, 0.7]))  # not Nesterov


# -- NoLoCo, two outer steps worked out by hand --------------------------------------------------
# One element, 4 replicas, H = 1, lr 0.5, mu 0.5, consensus c = 1, seed 1, heavy ball (the update of
# the NoLoCo authors' code: v <- mu v + lr g; phi <- phi - v). noloco_pairs(4, 1, k) pairs
# {0, 2}, {1, 3} at outer step 0 and {1, 2}, {0, 3} at outer step 1. Every replica starts at 1.
#   step 1: replica r moves down by (0.2, 0.4, 0.6, 0.0)[r]; the snapshots are all 1, so the
#           consensus term is 0 and g = the pair's mean pseudo-gradient: 0.4 for {0, 2}, 0.2 for
#           {1, 3}. m = g; phi = 1 - 0.5 m = (0.8, 0.9, 0.8, 0.9).
#   step 2: moves (0.2, 0.0, 0.2, 0.4). Pair {1, 2}: mean delta 0.1, mean phi 0.85, so
#           g1 = 0.1 + (0.9 - 0.85) = 0.15, g2 = 0.1 - 0.05 = 0.05; pair {0, 3}: mean delta 0.3,
#           g0 = 0.3 - 0.05 = 0.25, g3 = 0.35. m = 0.5 m + g = (0.45, 0.25, 0.25, 0.45);
#           phi = phi - 0.5 m = (0.575, 0.775, 0.675, 0.675).
# Nesterov would have stepped by lr (g + mu m) at step 1: phi = 1 - 0.75 g = (0.7, 0.85, 0.7, 0.85).
NOLOCO_MOVES = {1: (0.2, 0.4, 0.6, 0.0), 2: (0.2, 0.0, 0.2, 0.4)}


def noloco_by_hand(ctx, steps: int):
    x = nn.Parameter(torch.ones(1))
    loop = OuterLoop([("x", x)], torch_dist.group.WORLD, mode="noloco", outer_steps=1,
                     outer_lr=0.5, outer_momentum=0.5, seed=1, noloco_consensus=1.0)
    after = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            x.sub_(NOLOCO_MOVES[step][ctx.rank])
        loop.after_inner_step(step)
        after.append(float(x))
    return after


def test_noloco_outer_steps_equal_the_authors_update_worked_by_hand(dist):
    assert [noloco_pairs(4, 1, k)[0] for k in range(2)] == [((3, 1), (2, 0)), ((2, 1), (0, 3))]
    results = dist.run(WORLD, noloco_by_hand, 2)
    expected = [(0.8, 0.575), (0.9, 0.775), (0.8, 0.675), (0.9, 0.675)]
    for rank, (after, want) in enumerate(zip(results, expected)):
        assert after == pytest.approx(want, abs=1e-6), f"replica {rank}"
    assert results[0][0] != pytest.approx(0.7, abs=1e-3)  # not Nesterov


# -- (4) state_dict round trip -------------------------------------------------------------------
def _clone(state):
    return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else copy.copy(v))
            for k, v in state.items()}


def resume_bit_exactly(ctx, mode: str, steps: int, stop_at: int, options: dict):
    """Weights after ``steps`` straight through, after stopping at ``stop_at`` and resuming from
    the saved state into a new object, and after resuming without loading it."""
    group = torch_dist.group.WORLD

    def run(params, loop, first, last):
        for step in range(first, last + 1):
            with torch.no_grad():
                for index, p in enumerate(params.values()):
                    p.sub_(inner_update(ctx.rank, step, index, p.shape))
            loop.after_inner_step(step if loop.inner_steps == step - 1 else None)

    straight = {n: nn.Parameter(t) for n, t in initial_params().items()}
    run(straight, OuterLoop(straight.items(), group, mode=mode, **options), 1, steps)

    first = {n: nn.Parameter(t) for n, t in initial_params().items()}
    loop = OuterLoop(first.items(), group, mode=mode, **options)
    run(first, loop, 1, stop_at)
    saved_state = _clone(loop.state_dict())
    saved_weights = {n: p.detach().clone() for n, p in first.items()}
    run(first, loop, stop_at + 1, stop_at + 2)  # the old object moves on (its buffers too)

    resumed = {n: nn.Parameter(t.clone()) for n, t in saved_weights.items()}
    new_loop = OuterLoop(resumed.items(), group, mode=mode, **options)
    new_loop.load_state_dict(saved_state)
    run(resumed, new_loop, stop_at + 1, steps)

    unloaded = {n: nn.Parameter(t.clone()) for n, t in saved_weights.items()}
    run(unloaded, OuterLoop(unloaded.items(), group, mode=mode, **options), stop_at + 1, steps)
    new_loop.finish()
    return {"resumed_equal": all(torch.equal(resumed[n], straight[n]) for n in SHAPES),
            "unloaded_differs": any(not torch.equal(unloaded[n], straight[n]) for n in SHAPES)}


@pytest.mark.parametrize("mode, options", [
    ("diloco", dict(outer_steps=4, outer_lr=0.7, outer_momentum=0.9, fragments=2)),
    ("noloco", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9, seed=4)),
    ("co2", dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9, co2_clip=0.02)),
])
def test_state_dict_round_trip_resumes_bit_exactly(dist, mode, options):
    # stop in the middle of a window, after outer steps have built momentum (and, for co2, with
    # an average in flight)
    results = dist.run(WORLD, resume_bit_exactly, mode, 13, 7, options)
    for rank, result in enumerate(results):
        assert result["resumed_equal"], f"rank {rank}: resumed run differs"
        assert result["unloaded_differs"], f"rank {rank}: the state made no difference"


# -- tp: DTensor parameters, the replica group along dp_replicate -------------------------------
def outer_over_tensor_parallel(ctx, steps: int, options: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    replica, tp_rank = mesh["dp_replicate"].get_local_rank(), mesh["tp"].get_local_rank()
    params = {n: nn.Parameter(distribute_tensor(t, mesh["tp"], [Shard(0)]))
              for n, t in initial_params().items()}
    ledger = CommLedger()
    loop = OuterLoop(params.items(), mesh["dp_replicate"].get_group(), mode="diloco",
                     ledger=ledger, **options)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for index, p in enumerate(params.values()):
                full = inner_update(replica, step, index, p.shape)
                p._local_tensor.sub_(full.chunk(2, dim=0)[tp_rank])
        loop.after_inner_step(step)
    state = loop.state_dict()
    placements_kept = all(isinstance(state[k][n], DTensor)
                          and state[k][n].placements == params[n].placements
                          and state[k][n].shape == params[n].shape
                          for k in ("snapshot", "momentum") for n in SHAPES)
    fresh = OuterLoop(params.items(), mesh["dp_replicate"].get_group(), mode="diloco",
                      **options)
    fresh.load_state_dict(_clone(state))
    round_trip = all(torch.equal(a, b) for a, b in zip(fresh._snapshot, loop._snapshot)) and \
        all(torch.equal(a, b) for a, b in zip(fresh._momentum, loop._momentum))
    return {"replica": replica,
            "params": {n: p.detach().full_tensor() for n, p in params.items()},
            "placements_kept": placements_kept, "round_trip": round_trip,
            "ledger": {k: (r.calls, r.payload_bytes) for k, r in ledger.records.items()}}


def test_outer_loop_works_on_the_local_shards_of_tensor_parallel_parameters(dist):
    options = dict(outer_steps=2, outer_lr=0.7, outer_momentum=0.9)
    steps = 6
    results = dist.run(WORLD, outer_over_tensor_parallel, steps, options)
    expected, _ = reference("diloco", 2, steps, **options)
    for result in results:
        for name in SHAPES:
            torch.testing.assert_close(result["params"][name], expected[result["replica"]][name],
                                       rtol=RTOL, atol=ATOL)
        assert result["placements_kept"] and result["round_trip"]
        # each rank reduces its half of the model: 3 outer steps x 4 bytes x 12 elements
        assert result["ledger"] == {("dp_replicate", "all_reduce"): (3, 3 * 4 * P // 2)}


# -- (5) the ledger counts the bytes ---------------------------------------------------------------
@pytest.mark.parametrize("mode, options, op, calls", [
    ("diloco", dict(outer_steps=3), "all_reduce", 2),
    ("diloco", dict(outer_steps=3, fragments=3), "all_reduce", 6),
    ("noloco", dict(outer_steps=3), "send", 2),
    ("co2", dict(outer_steps=3), "all_reduce", 2),
])
def test_ledger_counts_the_outer_loop_bytes(dist, mode, options, op, calls):
    steps = 6
    results = dist.run(WORLD, run_outer, mode, steps, {**options, "outer_lr": 0.7})
    message = 4 * P  # fp32 pseudo-gradients of the whole (unsharded) model
    formula = replica_link_cost(mode, message_bytes=message, replicas=WORLD,
                                bandwidth_bytes_per_s=1e9, latency_s=0.0,
                                outer_steps=options["outer_steps"],
                                fragments=options.get("fragments", 1))
    for result in results:
        ledger = result["ledger"]
        took = sum(result["took"])
        assert took == calls  # outer steps taken (one call each: the model fits one bucket)
        count, payload, wire = ledger[("dp_replicate", op)]
        assert (count, payload) == (calls, 2 * message)  # two windows of the whole model
        assert wire == pytest.approx(formula.bytes_per_step * steps)
        if mode == "noloco":  # a pairwise exchange, no collective
            assert set(ledger) == {("dp_replicate", "send"), ("dp_replicate", "recv")}
            assert ledger[("dp_replicate", "recv")] == (calls, 2 * message, 0.0)
        else:
            assert wire == 2 * (WORLD - 1) / WORLD * payload  # ring all-reduce
            assert set(ledger) == {("dp_replicate", "all_reduce")}


# -- (6) bad input, refused by name -------------------------------------------------------------
def refusals(ctx):
    singles = [torch_dist.new_group([r]) for r in range(WORLD)]
    world = torch_dist.group.WORLD
    params = {n: nn.Parameter(t) for n, t in initial_params().items()}
    good = dict(mode="diloco", outer_steps=2, outer_lr=0.7)
    cases = [
        (dict(good, outer_steps=0), world, "outer_steps"),
        (dict(good, mode="fedavg"), world, "mode"),
        (dict(good), singles[ctx.rank], "group"),
        (dict(good, outer_lr=0.0), world, "outer_lr"),
        (dict(good, outer_momentum=1.0), world, "outer_momentum"),
        (dict(good, fragments=3), world, "fragments"),
        (dict(good, mode="noloco", fragments=2), world, "fragments"),
        (dict(good, mode="co2", co2_clip=-1.0), world, "co2_clip"),
    ]
    for options, group, name in cases:
        with pytest.raises(ValueError, match=name):
            OuterLoop(params.items(), group, **options)
    with pytest.raises(ValueError, match="named_parameters"):
        OuterLoop([], world, **good)
    loop = OuterLoop(params.items(), world, **good)
    with pytest.raises(ValueError, match="step"):
        loop.after_inner_step(5)  # the first inner step is 1
    co2 = OuterLoop(params.items(), world, **dict(good, mode="co2"))
    with pytest.raises(ValueError, match="mode"):
        co2.load_state_dict(loop.state_dict())
    return True


def test_bad_input_is_refused_by_name(dist):
    assert dist.run(WORLD, refusals) == [True] * WORLD


def tied_parameter_twice(ctx):
    """A Parameter listed twice (tied across pipeline stages on one rank) moves once."""
    shared = nn.Parameter(initial_params()["w1"])
    ledger = CommLedger()
    loop = OuterLoop([("first.w", shared), ("last.w", shared)], torch_dist.group.WORLD,
                     mode="diloco", outer_steps=1, outer_lr=0.5, outer_momentum=0.0,
                     ledger=ledger)
    with torch.no_grad():
        shared.sub_(inner_update(ctx.rank, 1, 0, shared.shape))
    loop.after_inner_step(1)
    return loop.names, ledger.get("dp_replicate", "all_reduce").payload_bytes, shared.detach()


def test_a_tied_parameter_is_updated_once(dist):
    results = dist.run(WORLD, tied_parameter_twice)
    start = initial_params()["w1"]
    mean = sum(start - inner_update(r, 1, 0, start.shape) for r in range(WORLD)) / WORLD
    for names, payload, value in results:
        assert names == ["first.w"] and payload == 4 * start.numel()
        # half way from the start to the replicas' mean (outer lr 0.5); a second pass over the
        # same Parameter would leave it a quarter of the way
        torch.testing.assert_close(value, start - 0.5 * (start - mean), rtol=RTOL, atol=ATOL)


# -- bf16 parameters: the outer loop merges their fp32 masters -------------------------------------
def run_outer_bf16(ctx, mode: str, steps: int, options: dict):
    """``run_outer`` with bf16 parameters keeping fp32 masters (``train.dtype = bf16``): the
    inner stand-in steps move the masters, and each parameter holds its master's rounding, as
    after an optimizer step's ``master_window``."""
    from loom.parallel.mixed_precision import MASTER, apply_bf16_parameters

    replica = torch_dist.get_rank()
    module = nn.ParameterDict({name: nn.Parameter(t) for name, t in initial_params().items()})
    apply_bf16_parameters(module, torch.float32)
    params = [(name, module[name]) for name in SHAPES]  # run_outer's order (the dict sorts)
    loop = OuterLoop(params, torch_dist.group.WORLD, mode=mode, **options)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for index, (_, p) in enumerate(params):
                master = getattr(p, MASTER)
                master.sub_(inner_update(replica, step, index, p.shape))
                p.copy_(master)
        loop.after_inner_step(step)
    loop.finish()
    return {name: (getattr(p, MASTER).clone(), p.detach().clone()) for name, p in params}


@pytest.mark.parametrize("case", ["diloco", "noloco", "co2"])
def test_bf16_parameters_are_merged_through_their_fp32_masters(dist, case):
    """The masters follow the fp32 run bit for bit (the same values enter the same arithmetic),
    and each bf16 parameter restarts at its master's rounding. Merging the bf16 values instead
    would lose every inner update below bf16's resolution (~4e-3 at these weights)."""
    mode, _, steps, options = CASES[case]
    fp32 = dist.run(WORLD, run_outer, mode, steps, options)
    bf16 = dist.run(WORLD, run_outer_bf16, mode, steps, options)
    for r in range(WORLD):
        for name in SHAPES:
            master, value = bf16[r][name]
            assert value.dtype == torch.bfloat16 and master.dtype == torch.float32
            assert torch.equal(master, fp32[r]["params"][name]), f"replica {r} {name}"
            assert torch.equal(value, master.to(torch.bfloat16)), f"replica {r} {name}"
