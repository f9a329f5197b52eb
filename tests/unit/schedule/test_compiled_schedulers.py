"""The compiled list schedulers (``loom/schedule/_listsched.c``) are the Python ones, to the bit.

``loom.schedule.compiled`` runs the search's three list schedulers in C when they were built and the costs
are floats; ``LOOM_PURE_PYTHON=1`` runs the Python code, which is their specification. On random
problems (placements of every kind and chunk count, unequal per-stage costs, with and without a
send time, memory limits from one unit to none, every knob) both must give the same rows, peak,
priorities, replayed times and stalls, compared with ``==`` on the floats.
"""

import random
from fractions import Fraction

import pytest

from loom.schedule import compiled
from loom.schedule.cost import StageCosts
from loom.schedule.families import get, names
from loom.schedule.replay import Costs, encode, score
from loom.schedule.search import search
from loom.schedule.search_greedy import Knobs, list_schedule
from loom.schedule.search_loop import Asap, Priorities
from loom.schedule.search_places import placement_of
from loom.schedule.search_priority import priority_schedule
from loom.schedule.search_reverse import ReverseKnobs, reverse_schedule

pytestmark = pytest.mark.skipif(not compiled.built(), reason="loom.schedule._listsched not built"
                                " (no C compiler at install): the Python schedulers run")

KINDS = [("looped", 1), ("interleaved", 2), ("interleaved", 3), ("v", 2), ("wave", 3),
         ("wave", 4)]


def _problem(rng: random.Random) -> tuple[tuple[int, ...], int, Costs, float]:
    p = rng.randint(1, 6)
    kind, v = rng.choice(KINDS) if p > 1 else ("looped", 1)
    layout = placement_of(kind, p, v)
    m = rng.randint(1, 3 * p + 3)
    stages = []
    decimal = rng.random() < 0.4  # tenths: sums that differ in the last bits (the EPS rules)
    for _ in layout:  # unequal stages, a few exact ties among them
        if decimal:
            f, i, w = (rng.choice([0.1, 0.2, 0.3, 0.7]) for _ in range(3))
        else:
            f = rng.choice([1.0, 0.5, rng.uniform(0.2, 2.0)])
            i, w = rng.choice([f, rng.uniform(0.2, 2.0)]), rng.uniform(0.1, 1.5)
        stages.append((f, i, w, i + w))
    send = rng.choice([0.0, 0.1 if decimal else 0.05, rng.uniform(0.0, 0.5)])
    limit = rng.choice([1.0, 1.5, p / 2, float(p), 2.0 * p, float("inf")])
    return layout, m, Costs(tuple(stages), send), limit


def _loops(costs: Costs):
    return compiled.loops_for(costs.duration, costs.send)


def _both(monkeypatch, build):
    """``build()`` compiled, then with the Python loops."""
    monkeypatch.delenv(compiled.PURE_PYTHON_VARIABLE, raising=False)
    assert _loops(Costs(((1.0, 1.0, 1.0, 2.0),), 0.0)) is not None
    fast = build()
    monkeypatch.setenv(compiled.PURE_PYTHON_VARIABLE, "1")
    slow = build()
    monkeypatch.delenv(compiled.PURE_PYTHON_VARIABLE)
    return fast, slow


def _same(fast, slow):
    assert (fast is None) == (slow is None)
    if fast is None:
        return False
    assert fast[0] == slow[0]  # the rows
    assert fast[1] == slow[1] and type(fast[1]) is type(slow[1])  # the peak
    return True


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_reverse_scheduler_is_the_python_one(monkeypatch, seed):
    rng = random.Random(seed)
    built = 0
    for _ in range(25):
        layout, m, costs, limit = _problem(rng)
        knobs = ReverseKnobs(i_first=rng.random() < 0.5, stagger=rng.choice([0.0, 0.9, 1.0, 1.2]))
        fast, slow = _both(monkeypatch, lambda: reverse_schedule(layout, m, costs, limit, knobs))
        if _same(fast, slow):
            built += 1
            # every action's latest start
            assert [list(t) for t in fast[2].tables] == [list(t) for t in slow[2].tables]
    assert built >= 15


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_priority_scheduler_is_the_python_one(monkeypatch, seed):
    rng = random.Random(100 + seed)
    built = stalled = 0
    for _ in range(25):
        layout, m, costs, limit = _problem(rng)
        reversed_ = reverse_schedule(layout, m, costs, limit, ReverseKnobs(stagger=1.0))
        if reversed_ is None:
            continue
        priority = reversed_[2]
        tie = rng.random()
        if tie < 0.4:  # priorities from a plain mapping, with ties broken by (stage, op, mb)
            priority = {key: float(round(value / 2)) if tie < 0.3 else 0.0
                        for key, value in priority.items()}
        reserve = rng.choice([None, 0, 1, 2])
        pp = max(layout) + 1
        patience = rng.choice([0.0, 0.3, [rng.choice([0.0, 0.25]) for _ in range(pp)]])
        asaps = []

        def build():
            asaps.append(Asap(layout, m, costs))
            return priority_schedule(layout, m, costs, limit, priority, reserve, patience,
                                     asaps[-1])

        fast, slow = _both(monkeypatch, build)
        if _same(fast, slow):
            built += 1
            assert asaps[0].first == asaps[1].first and asaps[0].end == asaps[1].end
            assert asaps[0].score(fast[0]) == asaps[1].score(slow[0])
        else:
            stalled += 1
    assert built >= 15


def test_exact_costs_and_the_variable_keep_the_python_loops(monkeypatch):
    monkeypatch.delenv(compiled.PURE_PYTHON_VARIABLE, raising=False)
    floats = Costs(((1.0, 1.0, 0.5, 1.5),) * 2, 0.0)
    assert _loops(floats) is not None
    # ints and Fractions: their arithmetic is exact in Python, not in doubles
    assert _loops(Costs(((1, 1, 1, 2),) * 2, 0)) is None
    assert _loops(Costs(((Fraction(1, 3), 1.0, 1.0, 2.0),), 0.0)) is None
    monkeypatch.setenv(compiled.PURE_PYTHON_VARIABLE, "1")
    assert _loops(floats) is None
    monkeypatch.setenv(compiled.PURE_PYTHON_VARIABLE, "0")
    assert _loops(floats) is not None


def test_priorities_read_as_a_mapping():
    layout = placement_of("v", 2, 2)
    costs = Costs(((1.0, 1.0, 0.5, 1.5),) * 4, 0.1)
    rows, _, latest = reverse_schedule(layout, 3, costs, 4.0, ReverseKnobs(stagger=1.0))
    assert isinstance(latest, Priorities) and len(latest) == 3 * 4 * 3
    assert sorted(latest) == sorted((s, o, k) for s in range(4) for o in range(3)
                                    for k in range(3))
    assert dict(latest.items()) == {key: latest[key] for key in latest}
    for bad in ((4, 0, 0), (0, 3, 0), (0, 0, 3), (-1, 0, 0)):
        with pytest.raises(KeyError):
            latest[bad]
    # a plain dict of the same priorities schedules the same
    assert priority_schedule(layout, 3, costs, 4.0, dict(latest), 0) == \
        priority_schedule(layout, 3, costs, 4.0, latest, 0)


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_list_scheduler_is_the_python_one(monkeypatch, seed):
    rng = random.Random(200 + seed)
    built = 0
    for _ in range(25):
        layout, m, costs, limit = _problem(rng)
        pp = max(layout) + 1
        caps = rng.choice([None, tuple(rng.uniform(1.0, pp + 1.0) for _ in range(pp))])
        knobs = Knobs(reserve=rng.choice([None, 0, 1, 2]), caps=caps,
                      patience=rng.choice([0.0, 0.1, 0.5]),
                      w_backlog=rng.choice([None, 0, pp // 2, pp]),
                      depth_first=rng.random() < 0.5, forward_first=rng.random() < 0.3,
                      w_fill=rng.choice([0.0, 0.5, 1.0]))
        fast, slow = _both(monkeypatch, lambda: list_schedule(layout, m, costs, limit, knobs))
        if (fast is None) != (slow is None):
            raise AssertionError("one deadlocked, the other did not")
        if fast is not None:
            assert fast == slow  # rows, makespan, peak
            built += 1
    assert built >= 12


def _orders(rng: random.Random):
    """Rows to replay: list-scheduled orders, every family's (split and unsplit backwards), and
    broken ones: two actions swapped (often a deadlock), one dropped, one twice, outside the grid,
    a rank with nothing."""
    for _ in range(8):
        layout, m, costs, limit = _problem(rng)
        made = list_schedule(layout, m, costs, limit, Knobs())
        if made is not None:
            yield made[0], layout, m, costs
    for family in names():
        p, m = rng.randint(2, 5), rng.randint(4, 12)
        try:
            schedule = get(family)(p, m)
        except ValueError:
            continue
        stages = [tuple(rng.choice([0.1, 0.2, 0.3, 0.7, 1.0]) for _ in range(3))
                  for _ in range(schedule.num_stages)]
        costs = Costs(tuple((f, i, w, i + w) for f, i, w in stages), rng.choice([0.0, 0.1]))
        rows = encode(schedule)
        if schedule.num_routes > 1:
            continue
        yield rows, schedule.placement, m, costs
        broken = [list(row) for row in rows]
        row = rng.choice([row for row in broken if len(row) > 2])
        at = rng.randrange(len(row) - 1)
        row[at], row[at + 1] = row[at + 1], row[at]
        yield broken, schedule.placement, m, costs
        dropped = [list(row) for row in rows]
        dropped[0].pop(rng.randrange(len(dropped[0])))
        yield dropped, schedule.placement, m, costs
        twice = [list(row) for row in rows]
        twice[-1].append(twice[-1][-1])
        yield twice, schedule.placement, m, costs
        outside = [list(row) for row in rows]
        outside[0].append((0, 0, m))
        yield outside, schedule.placement, m, costs
        yield [[]] + [list(row) for row in rows[1:]], schedule.placement, m, costs


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_replay_scores_as_the_python_one(monkeypatch, seed):
    rng = random.Random(300 + seed)
    scored = deadlocked = 0
    for rows, layout, m, costs in _orders(rng):
        fast, slow = _both(monkeypatch, lambda: score(rows, layout, m, costs))
        assert fast == slow
        if fast is None:
            deadlocked += 1
        else:
            scored += 1
            assert type(fast.makespan) is type(slow.makespan)
    assert scored >= 10 and deadlocked >= 3


def test_the_compiled_replay_hands_back_what_it_does_not_cover(monkeypatch):
    monkeypatch.delenv(compiled.PURE_PYTHON_VARIABLE, raising=False)
    loops, durations = _loops(Costs(((1.0, 1.0, 1.0, 2.0),) * 2, 0.1))
    ok = [[(0, 0, 0), (0, 1, 0), (0, 2, 0)], [(1, 0, 0), (1, 1, 0), (1, 2, 0)]]
    # F(0) 0-1 | F(1) 1.1-2.1, I(1) -3.1, W(1) -4.1 | I(0) 3.2-4.2 (after I(1) and a send), W(0)
    assert loops.replay(ok, (0, 1), 1, durations, 0.1) == ([0.0, 1.1], [5.2, 4.1])
    assert loops.replay(ok[::-1], (1, 0), 1, durations, 0.1) == ([1.1, 0.0], [4.1, 5.2])
    stuck = [[(0, 1, 0), (0, 0, 0), (0, 2, 0)], ok[1]]  # rank 0's I before its own F
    assert loops.replay(stuck, (0, 1), 1, durations, 0.1) is None
    assert loops.replay([[(0, 0, 0), (0, 0, 0)], []], (0, 1), 1, durations, 0.1) is False
    assert loops.replay([[(0, 4, 0)], []], (0, 1), 1, durations, 0.1) is False  # S
    assert loops.replay([[(2, 0, 0)], []], (0, 1), 1, durations, 0.1) is False  # no stage 2
    assert loops.replay([[(0, 0, 1)], []], (0, 1), 1, durations, 0.1) is False  # no mb 1


@pytest.mark.parametrize("p, m, costs, limit", [
    (4, 16, StageCosts.uniform(1, 1, 0.5, latency=0.05), 4),
    (8, 32, StageCosts.uniform(1, 2, 1, latency=0.1), 16),
    (12, 40, StageCosts.uniform(1, 1, 1), 6),  # above the screen's 8 ranks
])
def test_the_whole_search_finds_the_same_schedule_either_way(monkeypatch, p, m, costs, limit):
    fast, slow = _both(monkeypatch, lambda: search(p, m, costs, limit))
    assert fast.schedule.actions == slow.schedule.actions
    assert fast.schedule.name == slow.schedule.name
    assert fast.figures == slow.figures
    assert fast.leaderboard == slow.leaderboard and fast.candidates_tried == slow.candidates_tried
