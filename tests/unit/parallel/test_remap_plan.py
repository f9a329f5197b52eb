"""The remapping's plan (``loom.parallel.remap.build_remap``) without processes: for random
attention and linear layouts, the rows every rank sends, routed as ``all_to_all_single`` routes
them, land on every rank in its linear layout's order, and the way back restores the attention
layout (the all-to-all itself is tested over gloo in ``tests/dist/test_remap.py``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.data.zeppelin import Ranks, TokenCosts, plan_zeppelin
from loom.parallel.remap import build_remap


def _exchange(rows: list[np.ndarray], send: list[tuple[int, ...]]) -> list[np.ndarray]:
    """``all_to_all_single`` on every rank at once: rank p's rows cut by ``send[p]``, rank q
    receiving chunk q of every sender, senders in rank order."""
    cut = [np.split(r, np.cumsum(s)[:-1]) for r, s in zip(rows, send)]
    return [np.concatenate([cut[p][q] for p in range(len(rows))]) for q in range(len(rows))]


def _layouts(draw_perm: np.ndarray, cuts: list[int], ranks: int) -> list[np.ndarray]:
    bounds = [0] + sorted(cuts) + [len(draw_perm)]
    return [draw_perm[bounds[p]:bounds[p + 1]] for p in range(ranks)]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6).flatmap(lambda ranks: st.tuples(
    st.just(ranks), st.integers(0, 40).flatmap(lambda total: st.tuples(
        st.permutations(list(range(total))), st.permutations(list(range(total))),
        st.lists(st.integers(0, total), min_size=ranks - 1, max_size=ranks - 1),
        st.lists(st.integers(0, total), min_size=ranks - 1, max_size=ranks - 1))))))
def test_rows_land_in_the_target_order_and_come_back(case):
    ranks, (perm_a, perm_l, cuts_a, cuts_l) = case
    source = _layouts(np.array(perm_a, dtype=np.int64), cuts_a, ranks)
    target = _layouts(np.array(perm_l, dtype=np.int64), cuts_l, ranks)
    plans = [build_remap(source, p, None, target) for p in range(ranks)]
    sent = [source[p][plans[p].send_order] for p in range(ranks)]
    arrived = _exchange(sent, [plans[p].send_counts for p in range(ranks)])
    for q in range(ranks):
        assert len(arrived[q]) == sum(plans[q].recv_counts)
        assert arrived[q][plans[q].recv_order].tolist() == target[q].tolist()
    # back: the inverse permutations and the swapped counts
    back = [target[q][np.argsort(plans[q].recv_order, kind="stable")] for q in range(ranks)]
    returned = _exchange(back, [plans[q].recv_counts for q in range(ranks)])
    for p in range(ranks):
        undo = np.argsort(plans[p].send_order, kind="stable")
        assert returned[p][undo].tolist() == source[p].tolist()


def test_the_planners_layouts_move_only_the_surplus():
    part = plan_zeppelin([300, 20, 20, 10, 5, 5], Ranks(4, 2),
                         TokenCosts(1e-7, 2e-10, 1e-9, 1e-8, 1e-9, 1e-8))
    held, linear = [part.token_indices(r) for r in range(4)], part.linear_layout()
    moved = part.moved_tokens()
    assert part.remapped and (moved - np.diag(np.diag(moved))).sum() > 0
    for p in range(4):
        plan = build_remap(held, p, None, linear)
        assert list(plan.send_counts) == moved[p].tolist()
        assert list(plan.recv_counts) == moved[:, p].tolist()
