"""The simulator reproduces the published closed forms exactly.

Costs are ints or Fractions, so every comparison below is exact (no tolerance). Notation: p
pipeline ranks, m microbatches, v chunks (stages) per rank, T_F / T_I / T_W the per-stage
durations of forward, input gradient and weight gradient, T_B = T_I + T_W a full backward.
"""

from fractions import Fraction

import pytest

from loom.schedule import Action, Op
from loom.schedule.families import get
from loom.schedule import StageCosts, simulate

PP_SIZES = (2, 3, 4, 8)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", PP_SIZES)
@pytest.mark.parametrize("m_per_p", [Fraction(1, 2), 1, 3])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m_per_p):
    # Megatron (Narayanan et al. 2021 §2.2): t_pb = (p-1)(t_f+t_b) idle in a total of
    # (m+p-1)(t_f+t_b), i.e. (p-1)/(m+p-1) of the time; here T_F = T_B = 1 and no latency.
    m = max(1, int(m_per_p * p))
    result = simulate(get(name)(p, m), StageCosts.uniform(1, Fraction(1, 2), Fraction(1, 2)))
    assert result.makespan == (m + p - 1) * 2
    assert result.bubble_zb == Fraction(p - 1, m + p - 1)
    assert result.bubble_makespan == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize("p", PP_SIZES)
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("m", ["p", "2p", "3p", "p+1"])
@pytest.mark.parametrize("t_f, t_b", [(1, 1), (1, 2), (2, 3)])
def test_interleaving_divides_the_bubble_time_by_v(p, v, m, t_f, t_b):
    # Megatron §2.2.2: t_pb^int = (p-1)(t_f+t_b)/v with t_f, t_b the times of a rank's whole
    # model; one chunk takes t_f/v, t_b/v, so with per-chunk costs T_F, T_B the bubble time is
    # (p-1)(T_F+T_B), 1/v of 1F1B's (p-1)·v·(T_F+T_B) for the same per-rank model.
    m = {"p": p, "2p": 2 * p, "3p": 3 * p, "p+1": p + 1}[m]
    half_b = Fraction(t_b, 2)
    interleaved = simulate(
        get("interleaved_1f1b")(p, m, chunks=v), StageCosts.uniform(t_f, half_b, half_b)
    )
    assert interleaved.bubble_time_zb == (p - 1) * (t_f + t_b)
    one_f_one_b = simulate(get("1f1b")(p, m), StageCosts.uniform(v * t_f, v * half_b, v * half_b))
    assert interleaved.bubble_time_zb * v == one_f_one_b.bubble_time_zb
    assert interleaved.bubble_zb == Fraction(p - 1, v * m + p - 1)


# (T_F, T_I, T_W) where the ZB paper's handcrafted schedules behave as Table 2 says. ZB-H1 needs
# T_W <= T_F (a deferred W must fit in the gap a forward leaves); ZB-H2 also needs
# 2 T_W <= T_F + T_I (else its formula goes negative) and m >= 2p (its warm-up runs 2(p-1)
# forwards). Outside these the simulator measures more bubble than the formula, as it should.
ZB_COSTS = [(1, 1, 1), (2, 2, 1), (3, 2, 1), (2, 3, 2), (3, 3, 2), (3, 1, 1)]


@pytest.mark.parametrize("p", PP_SIZES)
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
@pytest.mark.parametrize("t_f, t_i, t_w", ZB_COSTS)
def test_zb_h1_bubble_is_p_minus_1_times_tf_plus_ti_minus_tw(p, m_per_p, t_f, t_i, t_w):
    # Qi et al. 2024 Table 2: ZB-H1 bubble (p-1)(T_F + T_B - T_W), T_B being the I pass.
    result = simulate(get("zb_h1")(p, m_per_p * p), StageCosts.uniform(t_f, t_i, t_w))
    assert result.bubble_time_zb == (p - 1) * (t_f + t_i - t_w)


@pytest.mark.parametrize("p", PP_SIZES)
@pytest.mark.parametrize("m_per_p", [2, 4])
@pytest.mark.parametrize("t_f, t_i, t_w", ZB_COSTS)
def test_zb_h2_bubble_is_p_minus_1_times_tf_plus_ti_minus_2tw(p, m_per_p, t_f, t_i, t_w):
    # Qi et al. 2024 Table 2: ZB-H2 bubble (p-1)(T_F + T_B - 2 T_W); zero when T_F = T_I = T_W.
    result = simulate(get("zb_h2")(p, m_per_p * p), StageCosts.uniform(t_f, t_i, t_w))
    assert result.bubble_time_zb == (p - 1) * (t_f + t_i - 2 * t_w)


def test_the_zb_h2_formula_needs_m_of_at_least_2p():
    # With m = p the warm-up is cut short and a bubble of T_F+T_I per hop remains.
    p = 4
    result = simulate(get("zb_h2")(p, p), StageCosts.uniform(1, 1, 1))
    assert result.bubble_time_zb > (p - 1) * (1 + 1 - 2 * 1)


@pytest.mark.parametrize("p", PP_SIZES)
@pytest.mark.parametrize("m_per_p", [1, 3])
def test_latency_adds_2_p_minus_1_sends_to_the_first_microbatch(p, m_per_p):
    # Qi et al. 2024 §3: the first microbatch's critical path is p(T_F + T_B) + 2(p-1) T_comm
    # (p-1 sends forward, p-1 gradients back); with m = 1 that is the whole makespan.
    t_f, t_i, t_w, t_comm = 2, 3, 1, Fraction(1, 3)
    m = m_per_p * p
    result = simulate(get("1f1b")(p, m), StageCosts.uniform(t_f, t_i, t_w, latency=t_comm))
    first = result.slot(Action(0, Op.B, 0)).finish
    assert first == p * (t_f + t_i + t_w) + 2 * (p - 1) * t_comm
    single = simulate(get("1f1b")(p, 1), StageCosts.uniform(t_f, t_i, t_w, latency=t_comm))
    assert single.makespan == p * (t_f + t_i + t_w) + 2 * (p - 1) * t_comm


def test_bandwidth_adds_message_bytes_over_bandwidth_to_each_send():
    p, latency, size, bandwidth = 4, Fraction(1, 10), 300, 1000
    costs = StageCosts.uniform(1, 1, 1, latency=latency, bandwidth=bandwidth, message_bytes=size)
    result = simulate(get("1f1b")(p, 1), costs)
    assert result.makespan == p * 3 + 2 * (p - 1) * (latency + Fraction(size, bandwidth))


@pytest.mark.parametrize("p", PP_SIZES)
def test_peak_memory_matches_the_papers(p):
    m = 4 * p
    # Megatron: 1F1B stashes p microbatches on rank 0 (p - r on rank r); GPipe all m.
    assert simulate(get("1f1b")(p, m)).peak_memory == tuple(p - r for r in range(p))
    assert simulate(get("gpipe")(p, m)).peak_memory == (m,) * p
    # Qi et al. 2024 Table 2: ZB-H1 p·M_B, ZB-H2 (2p-1)·M_B, ZB-V p·M_B on every rank.
    assert simulate(get("zb_h1")(p, m)).peak_memory == (p,) * p
    assert simulate(get("zb_h2")(p, m)).peak_memory == (2 * p - 1,) * p
    assert simulate(get("zbv")(p, m)).peak_memory == (p,) * p


@pytest.mark.parametrize("p", PP_SIZES)
def test_freeing_at_i_gives_the_zero_bubble_per_worker_memory(p):
    # Qi et al. 2024 §3: worker i (1-based) of ZB-H1 holds (p-i+1) M_B + (i-1) M_W, of ZB-H2
    # (2p-2i+1) M_B + (2i-2) M_W, when only M_W of M_B stays alive between I and W.
    m_w = Fraction(2, 5)  # M_W / M_B
    costs = StageCosts.uniform(1, 1, 1, weight_grad_fraction=m_w)
    h1 = simulate(get("zb_h1")(p, 3 * p), costs)
    h2 = simulate(get("zb_h2")(p, 3 * p), costs)
    workers = range(1, p + 1)
    assert h1.peak_memory == tuple((p - i + 1) + (i - 1) * m_w for i in workers)
    assert h2.peak_memory == tuple((2 * p - 2 * i + 1) + (2 * i - 2) * m_w for i in workers)
