"""bench/layout_fuzz.py --parity: which random layouts are held to one process, and how.

A draw is compared only where its arithmetic cannot depend on the layout; its one-process twin
keeps the model, data and training features and drops every parallel key; a run that logged
other numbers than its twin, or numbers further apart than the tolerance, is a mismatch."""

from __future__ import annotations

import math

from tests.conftest import load_bench

fuzz = load_bench("layout_fuzz")


def test_the_twin_keeps_the_features_and_drops_the_layout():
    draw = {"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.pp": 2,
            "parallel.schedule": "zbv", "model.n_experts": 4, "data.packing": "varlen",
            "data.tokens_per_microbatch": 512, "train.recompute": "full"}
    assert fuzz.reference_overrides(draw) == {
        "model.n_experts": 4, "data.packing": "varlen", "data.tokens_per_microbatch": 512,
        "train.recompute": "full"}


def test_draws_whose_numbers_depend_on_the_layout_have_no_twin():
    for key, value in [("parallel.grad_compression", "powersgd"), ("parallel.dp_mode", "diloco"),
                       ("train.dtype", "bf16"), ("train.grad_reduce_dtype", "bf16")]:
        assert fuzz.reference_overrides({"parallel.dp_shard": 2, key: value}) is None


def test_the_gap_is_the_largest_relative_difference_over_what_both_logged():
    want = {"loss@1": 4.0, "grad_norm@1": 2.0, "loss@2": 3.0}
    got = {"loss@1": 4.0, "grad_norm@1": 2.0002, "loss@2": 3.0}
    assert math.isclose(fuzz.relative_gap(got, want), 1e-4, rel_tol=1e-9)
    assert fuzz.relative_gap(want, want) == 0.0


def test_numbers_logged_differently_or_not_at_all_are_an_infinite_gap():
    want = {"loss@1": 4.0, "loss@2": 3.0}
    assert fuzz.relative_gap({"loss@1": 4.0}, want) == math.inf
    assert fuzz.relative_gap({}, {}) == math.inf


def test_the_numbers_are_read_from_the_runs_metrics_in_step_order(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.7, "grad_norm": 18.1, "lr": 0.001}\n'
        '{"step": 2, "loss": 5.0, "grad_norm": 8.5, "lr": 0.002}\n'
        '{"step": 2, "val/loss": 4.7}\n'
        '{"event": "done"}\n')
    assert list(fuzz.numbers(tmp_path).items()) == [
        ("loss@1", 5.7), ("grad_norm@1", 18.1), ("loss@2", 5.0), ("grad_norm@2", 8.5),
        ("val/loss@2", 4.7)]
    assert fuzz.numbers(tmp_path / "missing") == {}
