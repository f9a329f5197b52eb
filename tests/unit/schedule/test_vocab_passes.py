"""Vocabulary parallelism's passes in the schedule IR: placed, validated, replayed, drawn.

``loom.schedule.vocab_passes`` puts S (a shard's logits and softmax statistics) and T (the loss,
the shard's backward) of every microbatch on every rank; their number is the shard, which is the
rank. What must hold, as data, before any torch runs them:

* the barriers: T(m) on any rank waits for every shard's S(m), and the last stage's backward of m
  for every shard's T(m) — in ``dependencies``, in the replay's times, and in the validator,
  which refuses a pass on the wrong rank, a missing or repeated pass, T before S, and a
  placement that deadlocks on a barrier;
* the paper's 1F1B variant: plain 1F1B with ``delay`` more warm-up forwards holds p + delay
  microbatches on rank 0 (its Algorithm 2 block p + 1, Algorithm 1 block p + 2), and with real
  costs the delay hides the barriers: the step gets shorter from delay 0 to 1, and with one
  it is within 5% of the ideal (evenly spread work plus 1F1B's bubble), every rank equally busy;
* every one-route family takes the insertion and stays valid (the V variant on ``zbv``);
* S and T travel in JSON, not in torch's CSV; the simulator prices them with their own costs and
  the renderer draws them in their own colours;
* a config asks for it by ``parallel.vocab_parallel_pp`` and the combinations not built are
  refused by name.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from loom.errors import ConfigError
from loom.schedule.cost import StageCosts
from loom.schedule.families import get, names, routed
from loom.schedule.ir import Action, Op, Schedule, csv_text
from loom.schedule.render import OP_COLORS, to_chrome_trace
from loom.schedule.simulate import simulate
from loom.schedule.validate import ScheduleError, dependencies, execute, peak_memory, validate
from loom.schedule.vocab_passes import insert_vocab_passes, vocab_1f1b, vocab_schedule


def _with_row(schedule: Schedule, rank: int, row: list[Action]) -> Schedule:
    rows = list(schedule.actions)
    rows[rank] = tuple(row)
    return Schedule(schedule.num_stages, schedule.num_microbatches, schedule.placement,
                    tuple(rows), name=schedule.name)


def test_the_barriers_are_dependencies():
    schedule = vocab_1f1b(4, 4)
    assert dependencies(schedule, Action(2, Op.S, 1)) == (Action(3, Op.F, 1),)
    assert dependencies(schedule, Action(0, Op.T, 1)) == tuple(Action(r, Op.S, 1)
                                                               for r in range(4))
    last_backward = dependencies(schedule, Action(3, Op.B, 1))
    assert set(last_backward) == {Action(3, Op.F, 1), *(Action(r, Op.T, 1) for r in range(4))}
    # a middle stage's backward is unchanged: no barrier there
    assert dependencies(schedule, Action(1, Op.B, 1)) == (Action(1, Op.F, 1), Action(2, Op.B, 1))


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (2, 5), (4, 4), (4, 9)])
def test_every_pass_starts_after_its_barrier_in_the_replay(pp, microbatches):
    schedule = vocab_1f1b(pp, microbatches)
    validate(schedule)
    run = execute(schedule)
    last = schedule.num_stages - 1
    for mb in range(microbatches):
        s_done = max(run.finish[Action(r, Op.S, mb)] for r in range(pp))
        t_done = max(run.finish[Action(r, Op.T, mb)] for r in range(pp))
        for r in range(pp):
            assert run.start[Action(r, Op.S, mb)] >= run.finish[Action(last, Op.F, mb)]
            assert run.start[Action(r, Op.T, mb)] >= s_done
        assert run.start[Action(last, Op.B, mb)] >= t_done


@pytest.mark.parametrize("delay", [0, 1, 2])
def test_the_paper_1f1b_holds_p_plus_delay_on_the_first_rank(delay):
    schedule = vocab_1f1b(4, 12, delay)
    validate(schedule)
    assert peak_memory(schedule) == tuple(float(4 - r + delay) for r in range(4))
    rows = schedule.without_vocab_passes().actions
    assert [a for a in rows[3][:2 + delay]] == [Action(3, Op.F, mb) for mb in range(1 + delay)] \
        + [Action(3, Op.B, 0)]


def test_the_delay_hides_the_barriers_with_real_costs():
    # the output layer's share per rank: S = T = 1/8 of a stage's F; a message 1/4
    costs = StageCosts.uniform(1, 1, 1, latency=Fraction(1, 4))
    passes = (Fraction(1, 8), Fraction(1, 8))
    spans = [simulate(vocab_1f1b(4, 16, delay), costs, vocab_costs=passes).makespan
             for delay in (0, 1, 2)]
    assert spans[1] < spans[0]
    assert spans[2] <= spans[1]


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("head", [Fraction(1, 2), Fraction(2)])
def test_the_paper_1f1b_comes_close_to_the_ideal(pp, head):
    # the output layer costs `head` forwards of a stage (2 head backward), spread over p ranks;
    # ideal: plain 1F1B's (m + p - 1) (F + B) plus every rank's share of the passes, m 3 head / p
    m = 4 * pp
    costs = StageCosts.uniform(1, 1, 1, latency=Fraction(1, 20))
    result = simulate(vocab_1f1b(pp, m), costs, vocab_costs=(head / pp, 2 * head / pp))
    ideal = (m + pp - 1) * 3 + m * 3 * head / pp
    assert result.makespan <= ideal * Fraction(105, 100)
    assert len(set(result.busy)) == 1  # the same work on every rank


ONE_ROUTE = [name for name in names() if name not in routed()]


@pytest.mark.parametrize("family", ONE_ROUTE)
def test_every_one_route_family_takes_the_passes(family):
    try:
        base = get(family)(4, 8)
    except ValueError as err:
        pytest.skip(f"{family} cannot schedule p=4, m=8: {err}")
    schedule = vocab_schedule(base)
    validate(schedule)
    assert schedule.without_vocab_passes().actions == base.actions or family == "1f1b"
    for rank, row in enumerate(schedule.actions):
        assert sorted(a for a in row if a.op.is_vocab) == sorted(
            Action(rank, op, mb) for op in (Op.S, Op.T) for mb in range(8))


def test_routed_schedules_are_refused():
    with pytest.raises(ValueError, match="one route"):
        insert_vocab_passes(get(routed()[0])(4, 8))


def _rule(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as caught:
        validate(schedule)
    return caught.value.rule


def test_the_validator_refuses_broken_vocab_passes():
    good = vocab_1f1b(2, 3)
    row = list(good.actions[0])
    # a pass of another rank's shard
    wrong = [Action(1, a.op, a.microbatch) if a == Action(0, Op.S, 0) else a for a in row]
    assert _rule(_with_row(good, 0, wrong)) == "vocab"
    # a missing T
    assert _rule(_with_row(good, 0, [a for a in row if a != Action(0, Op.T, 2)])) == "vocab"
    # a repeated S
    assert _rule(_with_row(good, 0, row + [Action(0, Op.S, 1)])) == "duplicate"
    # T before S on one rank
    s_at, t_at = row.index(Action(0, Op.S, 1)), row.index(Action(0, Op.T, 1))
    swapped = list(row)
    swapped[s_at], swapped[t_at] = swapped[t_at], swapped[s_at]
    assert _rule(_with_row(good, 0, swapped)) == "order"
    # rank 0 waits in T(0) for rank 1's S(0), which waits behind rank 1's ... B(0), which needs
    # every T(0): a cycle through the barrier
    last = [a for a in good.actions[1] if a != Action(1, Op.S, 0)]
    last.insert(last.index(Action(1, Op.B, 0)) + 1, Action(1, Op.S, 0))
    last.remove(Action(1, Op.T, 0))
    last.insert(last.index(Action(1, Op.S, 0)) + 1, Action(1, Op.T, 0))
    assert _rule(_with_row(good, 1, last)) in ("deadlock", "order")


def test_json_round_trips_and_torch_csv_refuses():
    schedule = vocab_1f1b(2, 3)
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert Action.parse("1S2") == Action(1, Op.S, 2)
    with pytest.raises(ValueError, match="S, T"):
        csv_text(schedule)
    assert csv_text(schedule.without_vocab_passes())  # the stages' actions still export


def test_the_simulator_prices_the_passes_and_the_renderer_draws_them():
    schedule = vocab_1f1b(2, 4)
    cheap = simulate(schedule, vocab_costs=(Fraction(1, 10), Fraction(1, 10)))
    dear = simulate(schedule, vocab_costs=(2, 2))
    assert cheap.makespan < dear.makespan
    slot = dear.slot(Action(0, Op.T, 3))
    assert slot.finish - slot.start == 2
    assert dear.peak_memory == cheap.peak_memory  # S and T hold no stage activations
    trace = to_chrome_trace(dear)
    assert {"S", "T"} <= {event.get("cat") for event in trace["traceEvents"]}
    assert {"S", "T"} <= set(OP_COLORS)


# -- the config ---------------------------------------------------------------------------------


def _config(world: int = 2, **overrides):
    from loom.config import load_config, resolve

    base = {"model.preset": "debug", "train.global_batch_size": 4, "train.micro_batch_size": 1,
            "parallel.pp": 2, "parallel.vocab_parallel_pp": True, **overrides}
    return resolve(load_config(None, base), world)


def test_the_config_turns_it_on():
    from loom.config import job_of

    assert job_of(_config()).vocab_parallel_pp is True
    assert job_of(_config(4, **{"parallel.dp_replicate": 2,
                                "train.global_batch_size": 8})).vocab_parallel_pp is True
    # composed: checkpoints and bf16 (tests/dist/test_vocab_pp_checkpoint.py, _bf16.py)
    assert _config(**{"checkpoint.interval": 5}).checkpoint.interval == 5
    for dtype in ("bf16", "bf16_autocast"):
        assert _config(**{"train.dtype": dtype}).train.dtype == dtype
    # tp, and tp with sequence parallelism (tests/dist/test_pipeline_vocab_tp.py)
    assert _config(4, **{"parallel.tp": 2}).parallel.tp == 2
    assert _config(4, **{"parallel.tp": 2, "parallel.sequence_parallel": True}
                   ).parallel.sequence_parallel is True
    # cp (tests/dist/test_vocab_pp_cp.py)
    assert _config(4, **{"parallel.cp": 2}).parallel.cp == 2
    # an outer dp_mode (tests/dist/test_outer_trainer.py), an MoE model with ep
    # (tests/dist/test_pipeline_vocab.py)
    assert _config(4, **{"parallel.dp_replicate": 2, "train.global_batch_size": 8,
                         "parallel.dp_mode": "diloco"}).parallel.dp_mode == "diloco"
    assert _config(4, **{"parallel.ep": 2, "model.n_experts": 4,
                         "train.global_batch_size": 8}).parallel.ep == 2


@pytest.mark.parametrize("overrides, field", [
    ({"parallel.pp": 1, "world": 1}, "parallel.vocab_parallel_pp"),
    ({"model.vocab_size": 511}, "model.vocab_size"),
    ({"parallel.schedule": "bidirectional_v", "world": 4, "parallel.pp": 4,
      "train.global_batch_size": 8}, "parallel.schedule"),
])
def test_combinations_not_built_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError) as caught:
        _config(**overrides)
    assert caught.value.field_name == field
