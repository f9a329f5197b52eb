"""The transfers the runtime derives from a schedule pair up exactly, and cannot be mismatched.

No processes here: for every family and size, each receive some rank posts has exactly one send
from that peer with the same tag, same-rank hand-overs never go on the wire, and within a step no
(source, destination, tag) repeats (gloo matches messages by source and tag).
"""

from collections import Counter

import pytest

from loom.pipeline.transfers import forward_only, incoming, outgoing
from loom.schedule.select import schedule_for
from loom.schedule.families import names

SIZES = [(2, 2), (2, 5), (3, 7), (4, 4), (4, 9)]


def wire(schedule):
    """(sender, receiver, tag) of every send and every receive of one step."""
    sends, receives = Counter(), Counter()
    m = schedule.num_microbatches
    for rank, row in enumerate(schedule.actions):
        for action in row:
            need = incoming(schedule, rank, action)
            if need is not None:
                assert need.peer != rank
                receives[(need.peer, rank, need.tag(m))] += 1
            out = outgoing(schedule, action)
            if out is not None and out.peer != rank:
                sends[(rank, out.peer, out.tag(m))] += 1
    return sends, receives


@pytest.mark.parametrize("family", names())
@pytest.mark.parametrize("pp, microbatches", SIZES)
def test_every_receive_has_its_send_and_tags_are_unique(family, pp, microbatches):
    try:
        schedule = schedule_for(family, pp, microbatches)
    except ValueError as err:
        pytest.skip(str(err))
    for candidate in (schedule, forward_only(schedule)):
        sends, receives = wire(candidate)
        assert sends == receives
        assert max(sends.values(), default=1) == 1
        # Activations cross every rank boundary once per microbatch (twice with gradients).
        boundaries = sum(candidate.rank_of(s) != candidate.rank_of(s + 1)
                         for s in range(candidate.num_stages - 1))
        per_mb = 1 if candidate is not schedule else 2
        assert len(sends) == per_mb * boundaries * microbatches


def test_v_placement_turns_around_without_communication():
    schedule = schedule_for("zbv", 2, 3)  # stages 1 and 2 both on rank 1
    sends, _ = wire(schedule)
    assert all({sender, receiver} == {0, 1} for sender, receiver, _ in sends)
    assert len(sends) == 2 * 2 * 3  # stage boundaries 0|1 and 2|3, both directions
