"""The event model of one rank's streams (``loom.sim.streams``): collectives that share a link
queue, on two links they run side by side; the steady-state extension matches the full run."""

from __future__ import annotations

import pytest

from loom.sim.streams import EXACT_LAYERS, Op, Pieces, _events, chunked_overlap, layer_overlap, run


def test_two_collectives_on_one_link_take_the_sum_on_two_links_the_max():
    assert max(run([Op("inter", 2.0), Op("inter", 3.0)])) == 5.0
    assert max(run([Op("intra", 2.0), Op("inter", 3.0)])) == 3.0
    # behind one second of compute: on one link 5 - 1 exposed, on two 3 - 1
    assert layer_overlap(1, 1.0, [Pieces("inter", 2.0), Pieces("inter", 3.0)]) == 5.0
    assert layer_overlap(1, 1.0, [Pieces("intra", 2.0), Pieces("inter", 3.0)]) == 3.0


def test_a_dependency_waits_and_a_stream_is_fifo():
    ends = run([Op("compute", 1.0), Op("link", 0.5, (0,)), Op("link", 0.25)])
    assert ends == [1.0, 1.5, 1.75]  # the third is issued after the second on its stream
    with pytest.raises(ValueError):
        run([Op("compute", 1.0, (1,)), Op("link", 1.0)])


def test_reduction_pieces_after_each_layer_hide_but_the_last():
    # 4 layers of 1 s, 0.5 s of reduction per layer after each: only the last piece shows
    assert layer_overlap(4, 1.0, [Pieces("inter", 0.5)]) == 0.5
    # link-bound, 2 s per layer: the first starts after 1 s, 8 s of link: 9 - 4 exposed
    assert layer_overlap(4, 1.0, [Pieces("inter", 2.0)]) == 5.0
    # slack after the compute (the pipeline flush) drains it
    assert layer_overlap(4, 1.0, [Pieces("inter", 2.0)], slack=3.0) == 2.0


def test_prefetched_gathers_and_reductions_compete_on_one_link():
    # 3 layers of 1 s; gather 0.6 s per layer one ahead, reduce 0.6 s after each layer.
    # By hand: g0 [0, .6]; L0 [.6, 1.6]; g1 issued at L0's start, [.6, 1.2]; r0 [1.6, 2.2];
    # L1 [1.6, 2.6]; g2 issued at L1's start (after r0 on the link) [2.2, 2.8]; r1 [2.8, 3.4];
    # L2 waits for g2: [2.8, 3.8]; r2 [3.8, 4.4]. Exposed 4.4 - 3 = 1.4.
    pieces = [Pieces("inter", 0.6, before=True), Pieces("inter", 0.6)]
    assert layer_overlap(3, 1.0, pieces) == pytest.approx(1.4)
    # on separate links each hides alone: the first gather and the last reduction show
    apart = [Pieces("intra", 0.6, before=True), Pieces("inter", 0.6)]
    assert layer_overlap(3, 1.0, apart) == pytest.approx(1.2)


@pytest.mark.parametrize("gather,reduce,compute", [(0.6, 0.6, 1.0), (0.2, 0.3, 1.0),
                                                   (1.5, 0.5, 1.0), (0.1, 2.0, 0.7)])
def test_the_steady_state_extension_matches_the_full_event_run(gather, reduce, compute):
    pieces = [Pieces("inter", gather, before=True), Pieces("inter", reduce)]
    layers = 5 * EXACT_LAYERS
    compute_end, link_end = _events(layers, compute, pieces)
    exact = max(0.0, compute_end - layers * compute, link_end - layers * compute)
    assert layer_overlap(layers, compute, pieces) == pytest.approx(exact, rel=1e-9)


def test_chunked_tp_overlap_shows_one_chunk_of_the_smaller():
    # 1 s of GEMMs, 0.5 s of collective in 2 chunks: 0.25 + 1.0 (the GEMMs wait one chunk)
    assert chunked_overlap(1.0, 0.5, 2) == pytest.approx(1.25)
    # link-bound: 2 s of collective in 4 chunks, 1 s of GEMM: 2 + one GEMM chunk
    assert chunked_overlap(1.0, 2.0, 4) == pytest.approx(2.25)
