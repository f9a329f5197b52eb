"""The hung-rank diagnosis on hand-made progress records, ``CollectiveWatch`` on two real ranks
(counts, history, and ``torch.distributed`` left exactly as it was), the stop agreement of
preemption, and ``train.preempt_grace_s``'s rule."""

from __future__ import annotations

import pytest

from loom.train.watchdog import diagnose

NOW = 1000.0


def record(rank: int, counts: dict[str, int], *, members: dict[str, list[int]] | None = None,
           heartbeat: float = NOW, status: str = "running", step: int = 3) -> dict:
    members = members or {key: [0, 1] for key in counts}
    history = {key: [[n, f"all_reduce (dp, {n} elements)", step, NOW - 20 + n]
                     for n in range(max(1, count - 4), count + 1)]
               for key, count in counts.items()}
    last = max((h[-1] for h in history.values()), key=lambda e: e[3], default=None)
    return {"rank": rank, "pid": 100 + rank, "host": "elsewhere", "status": status, "step": step,
            "counts": counts, "members": members, "history": history, "last": last,
            "heartbeat": heartbeat, "progress": NOW - 10}


def no_state(rec):
    return None


def test_the_rank_behind_never_arrived_at_the_next_collective():
    records = {0: record(0, {"0": 7}), 1: record(1, {"0": 6}, heartbeat=NOW - 12)}
    found = diagnose(records, 0, now=NOW, state=no_state)
    assert found.culprits == [1]
    assert found.message.startswith("rank 1 never arrived at all_reduce (dp, 7 elements) of step 3;"
                                    " last seen 12 s ago at all_reduce (dp, 6 elements) of step 3")
    assert found.waited_s == pytest.approx(10)


def test_a_rank_at_the_same_count_whose_heartbeat_stopped_is_named():
    records = {0: record(0, {"0": 7}), 1: record(1, {"0": 7}, heartbeat=NOW - 9),
               2: record(2, {"0": 7}, members={"0": [0, 1, 2]})}
    found = diagnose(records, 0, now=NOW, state=no_state)
    assert found.culprits == [1]
    assert found.message.startswith("rank 1 stopped responding in all_reduce (dp, 7 elements) of"
                                    " step 3; last seen 9 s ago (pid 101)")


def test_a_cascade_names_the_root_not_the_ranks_waiting_for_it():
    # rank 2 waits for rank 0 on tp; rank 0 waits for rank 1 on dp: only rank 1 is hung.
    records = {
        0: record(0, {"dp": 5, "tp": 3}, members={"dp": [0, 1], "tp": [0, 2]}),
        1: record(1, {"dp": 4}, members={"dp": [0, 1]}),
        2: record(2, {"tp": 4}, members={"tp": [0, 2]}),
    }
    for reporter in (0, 2):
        found = diagnose(records, reporter, now=NOW, state=no_state)
        assert found.culprits == [1], reporter
        assert "rank 1 never arrived at all_reduce (dp, 5 elements)" in found.message


def test_no_hang_is_reported_for_a_crashed_peer_or_by_the_slow_rank_itself():
    crashed = {0: record(0, {"0": 7}), 1: record(1, {"0": 6}, status="failed")}
    assert diagnose(crashed, 0, now=NOW, state=no_state) is None
    gone = {0: record(0, {"0": 7}), 1: record(1, {"0": 6})}
    assert diagnose(gone, 0, now=NOW, state=lambda rec: "exited" if rec["rank"] == 1 else None) \
        is None
    assert diagnose(gone, 1, now=NOW, state=no_state) is None  # rank 1 is the one behind
    healthy = {0: record(0, {"0": 7}), 1: record(1, {"0": 7})}
    assert diagnose(healthy, 0, now=NOW, state=no_state) is None


def test_a_rank_that_never_reported_is_named():
    records = {0: record(0, {"0": 2})}
    found = diagnose(records, 0, now=NOW, state=no_state)
    assert found.culprits == [1] and "never reported" in found.message


def watch_two_ranks(ctx, run_dir: str):
    """Rank body: a few collectives under a CollectiveWatch; what it wrote, and whether
    torch.distributed is back to its own functions afterwards."""
    import torch
    import torch.distributed as dist

    from loom.train import preempt
    from loom.train.watchdog import CollectiveWatch, read_records

    before = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "isend")}
    with CollectiveWatch(run_dir, ctx.rank, timeout_s=30, group_names={}) as watch:
        patched = dist.all_reduce is not before["all_reduce"]
        watch.set_step(4)
        dist.all_reduce(torch.ones(3))
        dist.barrier()
        agreed = preempt.agree_to_stop(ctx.rank == 1, torch.device("cpu"))  # only rank 1 asks
        dist.barrier()
    restored = all(getattr(dist, name) is fn for name, fn in before.items())
    return patched, restored, agreed, read_records(run_dir)[ctx.rank]


def test_collective_watch_counts_and_restores_torch_distributed(dist, tmp_path):
    results = dist.run(2, watch_two_ranks, str(tmp_path))
    for rank, (patched, restored, agreed, rec) in enumerate(results):
        assert patched and restored and agreed
        assert rec["status"] == "finished" and rec["rank"] == rank and rec["step"] == 4
        assert list(rec["counts"].values()) == [4]  # all on the default group
        texts = [entry[1] for entry in next(iter(rec["history"].values()))]
        assert texts == ["all_reduce (world, 3 elements)", "barrier (world)",
                         "all_reduce (world, 1 element)", "barrier (world)"]


def test_preempt_grace_must_be_positive():
    from loom.config import ConfigError, load_config, resolve

    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, {"train.preempt_grace_s": "0"}), 1)
    assert err.value.field_name == "train.preempt_grace_s"


def test_a_frozen_rank_is_named_rather_than_the_live_neighbour_blocked_on_it():
    # pp = 3, rank 2 frozen (heartbeat stopped 15 s ago); rank 1 is live, blocked on it in an
    # op it has not recorded. Rank 0 waits for both on pp, or for rank 1 alone on their own
    # point-to-point key: either way only the frozen rank is named, never the live neighbour.
    pp = {"pp": [0, 1, 2]}
    both = {0: record(0, {"pp": 3}, members=pp),
            1: record(1, {"pp": 2}, members=pp, heartbeat=NOW - 0.9),
            2: record(2, {"pp": 2}, members=pp, heartbeat=NOW - 15)}
    pair = {"pp": [0, 1, 2], "p2p01": [0, 1]}
    one = {0: record(0, {"pp": 2, "p2p01": 5}, members=pair),
           1: record(1, {"pp": 2, "p2p01": 4}, members=pair, heartbeat=NOW - 0.9),
           2: record(2, {"pp": 2}, members=pp, heartbeat=NOW - 15)}
    for records in (both, one):
        found = diagnose(records, 0, now=NOW, state=no_state)
        assert found.culprits == [2]
        assert "last seen 15 s ago" in found.message
