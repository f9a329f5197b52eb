"""The multi-process harness itself: results in rank order, real collectives, failures reported,
pools with too many threads recycled."""

import os
import signal

import pytest
import torch
import torch.distributed as dist_api

from loom.testing.harness import HarnessError


def rank_times(ctx, x):
    return ctx.rank * x


def all_reduce_rank(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist_api.all_reduce(t)
    return t.item()


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on rank one")
    return ctx.rank


def die_on_rank_one(ctx, how):
    if ctx.rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return ctx.rank


def abort_natively_on_rank_one(ctx):
    """What a C++ abort looks like from Python: a message on fd 2, then SIGABRT, no traceback."""
    if ctx.rank == 1:
        os.write(2, b"terminate called after throwing an instance of 'gloo::IoException'\n")
        os.abort()
    return ctx.rank


def test_results_come_back_in_rank_order(dist):
    assert dist.run(4, rank_times, 10) == [0, 10, 20, 30]


def test_collectives_span_the_pool(dist):
    assert dist.run(4, all_reduce_rank) == [6.0] * 4


def test_a_failing_rank_is_named_and_the_pool_is_replaced(dist):
    with pytest.raises(HarnessError, match=r"failed on ranks \[1\][\s\S]*boom on rank one"):
        dist.run(2, fail_on_rank_one)
    assert dist.run(2, rank_times, 1) == [0, 1]  # a fresh pool answers


@pytest.mark.parametrize("how, note", [("exit", r"exit code 3"),
                                       ("kill", r"killed by SIGKILL; [\d.]+ GiB available now")])
def test_a_rank_that_dies_is_named_with_how_it_ended(dist, how, note):
    with pytest.raises(HarnessError, match=r"processes died: \['loom-rank1 \(" + note):
        dist.run(2, die_on_rank_one, how, task_timeout_s=30)
    assert dist.run(2, rank_times, 1) == [0, 1]


def test_a_native_abort_is_reported_with_what_the_rank_printed(dist):
    with pytest.raises(HarnessError, match=r"killed by SIGABRT[\s\S]*rank 1: stderr[\s\S]*"
                                           r"gloo::IoException"):
        dist.run(2, abort_natively_on_rank_one, task_timeout_s=30)
    assert dist.run(2, rank_times, 1) == [0, 1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads counted in /proc")
def test_a_pool_is_replaced_once_its_workers_hold_too_many_threads(dist):
    pool = dist.pool(2)
    assert dist.run(2, rank_times, 1) == [0, 1]
    assert pool.threads > 1  # the main thread and gloo's
    assert dist.pool(2) is pool  # below the limit: kept
    saved = dist.max_threads
    dist.max_threads = pool.threads
    try:
        fresh = dist.pool(2)
    finally:
        dist.max_threads = saved
    assert fresh is not pool and not pool.alive
    assert dist.run(2, rank_times, 2) == [0, 2]
