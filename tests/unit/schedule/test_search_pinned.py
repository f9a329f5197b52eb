"""The schedule search's results are pinned: the speed work of issue 22 (item 2) must not change
what it finds. Each case below was searched with the code before that work (commit 3f1b236) and
its winner, exact makespan, number of candidates and leaderboard (label, makespan, Zero Bubble
idle, peak) recorded; the search is deterministic (its effort is counted in simulated actions),
so today's search must reproduce every figure exactly, floats included. Hanayo's waves (issue
22 item 3) later added seeds (``hanayo(v=4)``, ...): the candidate counts grew by their number
and the p = 12 leaderboard gained a row; no winner or makespan changed. Later still, a screened
seed is priced at full size only while its actions fit in what is left of half the effort (it
used to be priced whenever any was left): three cases below priced one seed fewer, and their
candidate counts and leaderboard tails changed with the effort the later steps got; at p = 12
the winner is now the other of two forward-backward orders with the same makespan, idle and
peak (the old winner ranks second). No makespan of a winner changed.

The cases cover the paths the search takes: unscreened seeds with local improvement (p <= 8),
screened seeds (p > 8), the forward-backward and patient passes, the knob sweep, pinned
placements, per-rank costs and a limit below p. The tests after them check each shortcut the
speed work takes against the slow path it replaces."""

import pytest

import loom.schedule.search as search_module
import loom.schedule.search_pool as search_pool
from loom.schedule.cost import OpCosts, StageCosts
from loom.schedule.families import get
from loom.schedule.replay import encode, score
from loom.schedule.search import search
from loom.schedule.search_greedy import Knobs, list_schedule
from loom.schedule.search_loop import Asap
from loom.schedule.search_priority import priority_schedule
from loom.schedule.search_reverse import ReverseKnobs, reverse_schedule

# ((p, m, costs, limit, placement, max_chunks, effort), schedule name, makespan, candidates,
#  leaderboard); costs are F, I, W, latency, or one F, I, W per rank then the latency
PINNED = [
    ((2, 4, (1, 1, 1, 0), 2, 'any', 8, None),
     'search[interleaved_zb(v=8)]', 12.125, 41,
     (
      ('interleaved_zb(v=8)', 12.125, 0.125, 2.0),
      ('interleaved_zb(v=7)', 12.142857142857137, 0.14285714285714235, 2.0),
      ('greedy:wavex7:reserve=all', 12.142857142857137, 0.14285714285714235, 2.0),
      ('interleaved_zb(v=6)', 12.166666666666657, 0.16666666666666607, 2.0),
      ('interleaved_zb(v=5)', 12.199999999999989, 0.1999999999999993, 2.0),)),
    ((4, 8, (1, 1, 0.5, 0.05), 4, 'any', 8, None),
     'search[zbv+local]', 22.200000000000003, 122,
     (
      ('zbv+local', 22.200000000000003, 2.200000000000003, 4.0),
      ('zbv', 22.300000000000004, 2.3000000000000043, 4.0),
      ('interleaved_zb(v=5)', 22.300000000000008, 2.3000000000000256, 4.0),
      ('interleaved_zb(v=4)', 22.325000000000003, 2.325000000000003, 4.0),
      ('forward-backward:v:reverse,stagger=1,reserve=0,patience=0.5',
       22.350000000000005, 2.1500000000000057, 4.0),)),
    ((4, 12, (1, 1.2, 0.8, 0.02), 2.5, 'any', 8, None),
     'search[greedy:wavex6:reserve=all,patience=0.0666667,forward_first,w_fill=1+local]',
     50.71333333333366, 125,
     (
      ('greedy:wavex6:reserve=all,patience=0.0666667,forward_first,w_fill=1+local',
       50.71333333333366, 14.713333333333665, 2.0),
      ('greedy:wavex6:reserve=all,patience=0.0666667,forward_first,w_fill=1',
       50.87333333333366, 14.873333333333669, 2.0),
      ('greedy:wavex6:reserve=all,patience=0.0666667,w_backlog=4,forward_first,w_fill=1',
       50.87333333333366, 14.873333333333669, 2.0),
      ('greedy:wavex6:reserve=all,forward_first,w_fill=1',
       50.87333333333366, 14.873333333333669, 2.0),
      ('greedy:wavex6:reserve=all,patience=0.04,forward_first,w_fill=1',
       50.87333333333366, 14.873333333333669, 2.0),)),
    ((4, 16, (1, 1, 1, 0), 8, 'v', 8, None),
     'search[zbv]', 49.5, 5,
     (
      ('zbv', 49.5, 0.0, 4.0),
      ('dualpipev', 49.5, 1.5, 4.5),
      ('v_half', 52.5, 4.5, 3.0),
      ('v_min', 52.5, 4.5, 3.0),
      ('hanayo(v=2)', 54.0, 6.0, 4.0),)),
    ((6, 12, (1, 2, 1, 0.1), 6, 'any', 4, None),
     'search[interleaved_zb(v=4)]', 54.30000000000001, 111,
     (
      ('interleaved_zb(v=4)', 54.30000000000001, 6.300000000000011, 6.0),
      ('interleaved_zb(v=3)', 54.53333333333333, 6.5333333333333385, 6.0),
      ('interleaved_zb(v=2)', 55.60000000000001, 7.6000000000000085, 6.0),
      ('zbv', 55.80000000000002, 7.8000000000000185, 6.0),
      ('forward-backward:interleavedx4:reverse,stagger=1,reserve=all,patience=0',
       57.30000000000003, 9.300000000000033, 6.0),)),
    ((8, 16, (1, 1, 0.5, 0.05), 16, 'any', 8, None),
     'search[forward-backward:interleavedx8:reverse,stagger=1,reserve=0,patience=0]',
     41.56250000000001, 119,
     (
      ('forward-backward:interleavedx8:reverse,stagger=1,reserve=0,patience=0',
       41.56250000000001, 1.562500000000007, 16.0),
      ('forward-backward:interleavedx8:reverse,stagger=1,reserve=all,patience=0',
       41.56250000000001, 1.562500000000007, 16.0),
      ('forward-backward:interleavedx8:reverse,stagger=1.2,reserve=0,patience=0',
       41.56250000000001, 1.562500000000007, 16.0),
      ('forward-backward:interleavedx8:reverse,stagger=1,reserve=1,patience=0',
       41.56250000000001, 1.562500000000007, 16.0),
      ('forward-backward:interleavedx8:reverse,reserve=0,patience=0',
       41.57500000000001, 1.57500000000001, 16.0),)),
    ((8, 32, (1, 2, 1, 0.1), 8, 'interleaved', 8, None),
     'search[interleaved_zb(v=2)]', 138.59999999999997, 39,
     (
      ('interleaved_zb(v=2)', 138.59999999999997, 10.599999999999966, 8.0),
      ('greedy:interleaved:reserve=0', 140.99999999999997, 12.999999999999972, 8.0),
      ('greedy:interleaved:reserve=0,w_backlog=8', 140.99999999999997, 12.999999999999972, 8.0),
      ('greedy:interleaved:reserve=1', 142.09999999999994, 14.099999999999937, 8.0),
      ('greedy:interleaved:reserve=0,w_backlog=4', 142.59999999999994, 14.599999999999937, 8.0),)),
    ((8, 24, ((1, 1, 1), (1.2, 1, 1), (1, 1.5, 0.5), (1, 1, 1), (1, 1, 1), (0.9, 1, 1),
              (1, 1, 1), (1.3, 1.3, 1.3), 0.05), 8, 'any', 4, None),
     'search[interleaved_zb(v=4)]', 95.7250000000005, 23,
     (
      ('interleaved_zb(v=4)', 95.7250000000005, 23.600000000000463, 8.0),
      ('interleaved_zb(v=3)', 96.31666666666672, 24.033333333333246, 8.0),
      ('greedy:wavex3:reserve=all', 96.89999999999998, 24.89999999999992, 8.0),
      ('zbv', 97.5000000000002, 2.842170943040401e-14, 8.0),
      ('interleaved_zb(v=2)', 97.5000000000002, 24.900000000000134, 8.0),)),
    ((12, 48, (1, 1, 0.5, 0.05), 24, 'any', 8, 200000),
     'search[forward-backward:interleavedx5:reverse,stagger=1,reserve=0,patience=0]',
     122.75000000000033, 29,
     (
      ('forward-backward:interleavedx5:reverse,stagger=1,reserve=0,patience=0',
       122.75000000000033, 0.10000000000039222, 23.2),
      ('forward-backward:interleavedx5:reverse,stagger=1,reserve=0,patience=0.25,calm=2',
       122.75000000000033, 0.10000000000039222, 23.2),
      ('greedy:interleavedx5:reserve=1', 122.75000000000027, 0.40000000000077307, 24.0),
      ('greedy:interleavedx5:reserve=0', 122.75000000000034, 2.100000000000719, 24.0),
      ('forward-backward:interleavedx5:reverse,i_first,stagger=0.9,reserve=0,patience=0.2,'
       'calm=3', 122.85000000000038, 2.8000000000004093, 23.2),)),
    ((16, 64, (1, 1, 1, 0), 32, 'any', 8, 200000),
     'search[interleaved_zb(v=8)]', 193.875, 5,
     (
      ('interleaved_zb(v=8)', 193.875, 1.875, 16.0),
      ('interleaved_zb(v=7)', 194.14285714285404, 2.142857142857082, 16.0),
      ('interleaved_zb(v=6)', 194.49999999999767, 2.499999999999858, 16.0),
      ('interleaved_zb(v=5)', 194.99999999999747, 2.9999999999998295, 16.0),
      ('interleaved_zb(v=4)', 195.75, 3.75, 16.0),)),
    ((16, 64, (1, 1, 0.5, 0.05), 32, 'any', 8, 200000),
     'search[forward-backward:interleavedx5:reverse,stagger=1,reserve=0,patience=0.25,calm=2]',
     163.7499999999997, 18,
     (
      ('forward-backward:interleavedx5:reverse,stagger=1,reserve=0,patience=0.25,calm=2',
       163.7499999999997, 0.10000000000155751, 31.4),
      ('forward-backward:wavex3:reverse,i_first,stagger=1,reserve=0,patience=0',
       165.74999999999963, 0.0, 32.0),
      ('forward-backward:wavex3:reverse,stagger=1,reserve=0,patience=0',
       165.74999999999966, 0.10000000000005116, 31.0),
      ('interleaved_zb(v=5)', 170.69999999999928, 10.70000000000067, 16.0),
      ('greedy:interleavedx5:reserve=1', 171.00000000000014, 11.000000000001933, 32.0),)),
    ((16, 128, (1, 2, 1, 0.1), 16, 'looped', 8, 300000),
     'search[zb_h1]', 548.0000000000007, 25,
     (
      ('zb_h1', 548.0000000000007, 36.00000000000068, 16.0),
      ('greedy:looped:reserve=all,caps=16..1,patience=0.5',
       560.0000000000003, 48.00000000000034, 16.0),
      ('greedy:looped:reserve=all,caps=16..1,patience=0.5',
       560.0000000000003, 48.00000000000034, 16.0),
      ('greedy:looped:reserve=all,caps=16..1,patience=0.5,breadth_first',
       560.0000000000003, 48.00000000000034, 16.0),
      ('greedy:looped:reserve=all,caps=16..1,patience=0.5,w_backlog=0',
       560.0000000000003, 48.00000000000034, 16.0),)),
]


def _costs(spec: tuple) -> StageCosts:
    if isinstance(spec[0], tuple):
        return StageCosts(tuple(OpCosts(*stage) for stage in spec[:-1]), latency=spec[-1])
    return StageCosts.uniform(*spec)


@pytest.mark.parametrize("case, name, makespan, tried, leaderboard", PINNED,
                         ids=[f"p{c[0][0]}-m{c[0][1]}-L{c[0][3]}-{c[0][4]}" for c in PINNED])
def test_search_finds_exactly_what_it_found_before_the_speed_work(case, name, makespan, tried,
                                                                   leaderboard):
    p, m, costs, limit, placement, max_chunks, effort = case
    options = {} if effort is None else {"effort": effort}
    result = search(p, m, _costs(costs), limit, placement, max_chunks=max_chunks, **options)
    assert result.schedule.name == name
    assert float(result.sim_result.makespan) == makespan
    assert result.figures == result.sim_result.figures  # the search's headline is simulate's
    assert result.candidates_tried == tried
    board = tuple((c.label, c.makespan, c.idle_zb, c.peak) for c in result.leaderboard)
    assert board == leaderboard


# What the speed work rests on, each checked against the slow path it replaces.

UNEQUAL = StageCosts.uniform(1, 1, 0.5, latency=0.05)
UNEVEN = StageCosts((OpCosts(1, 1, 1), OpCosts(1.2, 1, 0.9), OpCosts(1, 2, 1), OpCosts(0.7, 1, 1)),
                    latency=0.1)


@pytest.mark.parametrize("costs", [UNEQUAL, UNEVEN, StageCosts.uniform(1, 1.3, 0.7)],
                         ids=["latency", "per-rank", "no-latency"])
@pytest.mark.parametrize("place", [("looped", 1), ("interleaved", 3), ("v", 2), ("wave", 4)])
def test_the_score_kept_while_a_forward_pass_runs_is_the_replay_s_to_the_bit(costs, place):
    p, m = 4, 11
    problem = search_module._Problem(p, m, costs)
    layout, fast = problem.layout(place), problem.fast(place)
    compared = 0
    for limit in (1.5, p, 2 * p):
        for knobs in (ReverseKnobs(stagger=1.0), ReverseKnobs(stagger=0.9, i_first=True)):
            made = reverse_schedule(layout, m, fast, limit, knobs)
            if made is None:
                continue
            for reserve, patience in ((0, 0.0), (None, 0.3), (1, [0.2] * (p - 1) + [0.0])):
                asap = Asap(layout, m, fast)
                forward = priority_schedule(layout, m, fast, limit, made[2], reserve, patience,
                                            asap)
                if forward is not None:
                    assert asap.score(forward[0]) == score(forward[0], layout, m, fast)
                    compared += 1
    assert compared >= 6


def test_the_pool_replays_an_idle_only_where_it_can_change_the_order():
    problem = search_module._Problem(4, 8, UNEQUAL)
    place = ("interleaved", 2)
    layout, fast = problem.layout(place), problem.fast(place)
    lazy, eager = search_pool.Pool(), search_pool.Pool()
    for n, reserve in enumerate((None, 0, 1, 2)):
        for patience in (0.0, 0.1, 0.5):
            rows, makespan, peak = list_schedule(layout, 8, fast, 8,
                                                 Knobs(reserve=reserve, patience=patience))
            label = f"{n}:{patience}"
            eager.add(search_module.Candidate(label, place[0], makespan, peak,
                                              score(rows, layout, 8, fast).idle_zb, 2), rows)
            lazy.add(search_module.Candidate(label, place[0], makespan, peak, 0.0, 2), rows,
                     idle_from=(layout, 8, fast))
    for count in (1, 3, 5):
        assert [c for c, _ in lazy.best(count)] == [c for c, _ in eager.best(count)]
    fifth = eager.best(5)[-1][0].makespan
    assert lazy.unscored  # the ones longer than the fifth were never replayed
    assert all(lazy.entries[n][0].makespan > fifth for n in lazy.unscored)
    assert [c for c, _ in lazy.best(12)] == [c for c, _ in eager.best(12)]


def test_the_winner_s_completeness_check_refuses_what_validate_would():
    for family in ("zb_h1", "1f1b", "dualpipev", "interleaved_1f1b"):  # I and W, B, both mixed
        schedule = get(family)(2, 4)
        search_module._check_complete(encode(schedule), schedule.placement, 4, family)
    rows = encode(get("zb_h1")(2, 3))
    layout = (0, 1)
    broken = {
        "duplicate W, missing W": [rows[0][:-1] + [rows[0][-2]], rows[1]],
        "missing W": [rows[0][:-1], rows[1]],
        "wrong rank": [rows[0] + [rows[1][-1]], rows[1][:-1]],
        "microbatch out of range": [rows[0][:-1] + [(0, 2, 3)], rows[1]],
        "a B for a W": [rows[0][:-1] + [(rows[0][-1][0], 3, rows[0][-1][2])], rows[1]],
        "a B beside I and W": [rows[0] + [(0, 3, 0)], rows[1]],
    }
    full = encode(get("1f1b")(2, 3))
    with pytest.raises(AssertionError, match="search"):  # a B missing
        search_module._check_complete([full[0][:-1], full[1]], layout, 3, "missing B")
    for what, bad in broken.items():
        with pytest.raises(AssertionError, match="search"):
            search_module._check_complete(bad, layout, 3, what)
