"""An emulated slower device: the compute inside ``slowed_to`` takes 1/speed of its own time, and
the cluster's node factors become speeds relative to the fastest node."""

from __future__ import annotations

import time

import pytest
import torch

from loom.cluster import Link, regions
from loom.emulate import compute_speed_of, compute_speeds
from loom.train.emulated_speed import slowed_to


def test_the_body_is_stretched_to_one_over_speed_of_its_time():
    start = time.perf_counter()
    with slowed_to(0.25, torch.device("cpu")):
        time.sleep(0.05)
    took = time.perf_counter() - start
    assert 0.19 <= took <= 0.35  # 0.05 s of work at a quarter speed: 0.2 s


def test_full_speed_adds_nothing_and_bad_speeds_are_refused():
    start = time.perf_counter()
    with slowed_to(1.0, torch.device("cpu")):
        time.sleep(0.02)
    assert time.perf_counter() - start < 0.05
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        with slowed_to(2.0, torch.device("cpu")):
            pass


def test_speeds_are_relative_to_the_fastest_node():
    cluster = regions([1, 2], intra=Link(0.0, 1e9), inter=Link(0.0, 1e8), compute=[2.0, 0.5])
    value = compute_speeds(cluster)
    assert [compute_speed_of(value, rank) for rank in range(3)] == [1.0, 0.25, 0.25]
    with pytest.raises(ValueError, match="rank 3"):
        compute_speed_of(value, 3)
