"""How bench/lowcomm_convergence.py reads L-GreCo against a fixed-rank PowerSGD sweep (issue 19's
"fewer bytes at the same final loss"): the fixed-rank bytes at a given loss are interpolated in
log bytes between the two ranks whose losses bracket it, and nothing is extrapolated."""

from __future__ import annotations

import math

import pytest

from tests.conftest import load_bench

SWEEP = [(2.80, 67.0), (2.68, 128.0), (2.60, 248.0)]  # (val loss, bytes/token): ranks 1, 2, 4


@pytest.fixture(scope="module")
def bench():
    return load_bench("lowcomm_convergence")


def test_a_fixed_rank_loss_costs_that_rank_bytes(bench):
    for loss, size in SWEEP:
        assert bench.fixed_rank_bytes_at(loss, SWEEP) == pytest.approx(size)


def test_between_two_ranks_the_bytes_are_geometric(bench):
    halfway = (2.68 + 2.60) / 2
    assert bench.fixed_rank_bytes_at(halfway, SWEEP) == pytest.approx(math.sqrt(128 * 248))
    # the order the runs were recorded in does not matter
    assert bench.fixed_rank_bytes_at(halfway, SWEEP[::-1]) == pytest.approx(math.sqrt(128 * 248))


@pytest.mark.parametrize("loss", [2.59, 2.81])
def test_outside_the_sweep_there_is_no_answer(bench, loss):
    assert bench.fixed_rank_bytes_at(loss, SWEEP) is None


def test_the_table_compares_each_seed_latest_lgreco_run(bench, capsys):
    def run(mode, loss, size, **outer):
        return {"seed": 7, "steps": 96, "mode": mode, "outer": outer, "val_loss": loss,
                "bytes_per_token": size}
    records = [run("powersgd4", loss, size, **{"parallel.compression_rank": str(rank)})
               for rank, (loss, size) in zip((1, 2, 4), SWEEP)]
    records += [run("lgreco", 2.75, 120.0), run("lgreco", 2.64, 100.0)]  # an older version first
    bench.print_lgreco_table(records)
    out = capsys.readouterr().out
    needed = math.sqrt(128 * 248)
    assert f"2.640 @ 100 (r4) | {needed:.0f} | {needed / 100:.2f}x |" in out
    assert "2.750" not in out


def test_a_run_outside_the_sweep_is_a_bound_and_seeds_are_also_pooled(bench, capsys):
    def run(seed, mode, loss, size, **outer):
        return {"seed": seed, "steps": 96, "mode": mode, "outer": outer, "val_loss": loss,
                "bytes_per_token": size}
    records = []
    for seed, shift in ((1, 0.0), (2, 0.1)):
        records += [run(seed, "powersgd4", loss + shift, size,
                        **{"parallel.compression_rank": str(rank)})
                    for rank, (loss, size) in zip((1, 2, 4), SWEEP)]
    records += [run(1, "lgreco", 2.64, 100.0), run(2, "lgreco", 3.0, 100.0)]  # seed 2: worst
    records += [run(1, "sync", 2.50, 9000.0), run(2, "sync", 2.60, 9000.0)]
    bench.print_lgreco_table(records)
    out = capsys.readouterr().out
    assert "worse than every rank | < 0.67x |" in out
    assert "(1 of them a bound: outside the sweep)" in out
    # pooled: fixed 2.85 @ 67, 2.73 @ 128, 2.65 @ 248 against L-GreCo's mean 2.82 @ 100
    assert "mean over the 2 seeds: fixed r1 2.850 @ 67, r2 2.730 @ 128, r4 2.650 @ 248" in out
    needed = 67 * (128 / 67) ** ((2.85 - 2.82) / (2.85 - 2.73))
    assert f"lgreco 2.820 @ 100; fixed rank's bytes at its loss | fewer: {needed:.0f} |" in out
    assert f"sync 2.550 on the mean; fixed rank / sync: r1 {2.85 / 2.55:.3f}" in out
