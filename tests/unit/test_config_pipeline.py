"""The pipeline rules of loom.config: schedule family, chunks, layers per stage, microbatches.

Every refused config names the field, the value and the rule (``config error: FIELD=VALUE:
RULE``); the valid ones resolve. ``loom train`` turns these errors into exit code 2 before any
process starts (checked end to end in tests/dist/test_pipeline_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError, load_config, resolve

torch.set_num_threads(1)

PP2 = {"parallel.pp": "2", "train.global_batch_size": "8", "train.micro_batch_size": "1"}

# Columns: overrides, world size, field named, "field=value" as printed, words of the rule.
REJECTED = [
    ({**PP2, "parallel.schedule": "zbvv"}, 2, "parallel.schedule", "parallel.schedule='zbvv'",
     ["unknown schedule", "known: gpipe, 1f1b", "did you mean 'zbv'?"]),
    ({**PP2, "parallel.schedule": "interleaved"}, 2, "parallel.schedule",
     "parallel.schedule='interleaved'", ["unknown schedule", "did you mean 'interleaved_1f1b'?"]),
    ({**PP2, "parallel.chunks": "-1"}, 2, "parallel.chunks", "parallel.chunks=-1",
     ["must be >= 0", "family's default"]),
    ({**PP2, "parallel.schedule": "zbv", "parallel.chunks": "3"}, 2, "parallel.chunks",
     "parallel.chunks=3", ["'zbv' places a fixed 2 stage(s) per rank", "use chunks = 0 or 2"]),
    ({**PP2, "parallel.schedule": "1f1b", "parallel.chunks": "2"}, 2, "parallel.chunks",
     "parallel.chunks=2", ["fixed 1 stage(s) per rank"]),
    # Layers: pp alone, then the stages a family with several chunks per rank needs.
    ({**PP2, "parallel.pp": "8"}, 8, "parallel.pp", "parallel.pp=8",
     ["must not exceed model.n_layers = 4"]),
    ({**PP2, "parallel.pp": "4", "parallel.schedule": "zbv"}, 4, "parallel.schedule",
     "parallel.schedule='zbv'", ["8 stages (pp = 4 x 2 per rank)", "model.n_layers >= 8, got 4"]),
    ({**PP2, "parallel.schedule": "looped_bfs", "parallel.chunks": "3"}, 2, "parallel.chunks",
     "parallel.chunks=3", ["6 stages", "model.n_layers >= 6, got 4"]),
    # Microbatches per pipeline m = global_batch_size / (dp * micro_batch_size).
    ({**PP2, "parallel.schedule": "dualpipev", "train.global_batch_size": "3"}, 2,
     "parallel.schedule", "parallel.schedule='dualpipev'",
     ["m = global_batch_size / (dp * micro_batch_size) = 3 / (1 * 1) = 3",
      "needs microbatches >= 4 for pp_size=2"]),
    ({**PP2, "parallel.pp": "4", "model.n_layers": "8", "parallel.schedule": "interleaved_1f1b",
      "train.global_batch_size": "6"}, 8, "parallel.schedule",
     "parallel.schedule='interleaved_1f1b'",
     ["= 6 / (2 * 1) = 3", "needs microbatches >= 4 for pp_size=4"]),
    # Tied embeddings across stages: a V placement shares one Parameter, which ZeRO-3 cannot
    # shard in two stages.
    ({**PP2, "model.tie_embeddings": "true", "parallel.schedule": "zbv",
      "parallel.dp_shard": "2", "parallel.reshard_after_forward": "false"}, 4,
     "parallel.dp_shard", "parallel.dp_shard=2", ["first and last stage on one rank",
                                                  "use dp_replicate or a looped schedule"]),
    # The schedule search (parallel.schedule = "search") and its two knobs.
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_costs": "1,1,0,0"}, 2,
     "parallel.schedule_costs", "parallel.schedule_costs='1,1,0,0'",
     ["must be F,I,W,latency", "F, I, W > 0"]),
    # a step of 2 x 300,000 x 2 (stage, microbatch) pairs: validating it built 1.2 million
    # actions (p = 64 with 10^5 microbatches took 289 s and 12 GB before this refusal)
    ({**PP2, "train.global_batch_size": "300000"}, 2, "parallel.pp", "parallel.pp=2",
     ["= 300000 / (1 * 1) = 300000", "the step is 1,200,000 (stage, microbatch) pairs",
      "at most 1,048,576"]),
    ({**PP2, "parallel.schedule": "search", "train.global_batch_size": "70000"}, 2,
     "parallel.pp", "parallel.pp=2", ["up to 8 stages per rank", "1,120,000"]),
    # NaN passed every comparison; a latency of 1e300 made the search's makespans infinite
    *[({**PP2, "parallel.schedule": "search", "parallel.schedule_costs": costs}, 2,
       "parallel.schedule_costs", f"parallel.schedule_costs='{costs}'",
       ["must be F,I,W,latency", "each at most 1e+15"])
      for costs in ("1,1,1,1e300", "nan,1,1,0", "1,inf,1,0")],
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_costs": "1,1,1;1,1,1;1,1,1,0"}, 2,
     "parallel.schedule_costs", "parallel.schedule_costs='1,1,1;1,1,1;1,1,1,0'",
     ["names 3 ranks' costs", "one per rank (2)"]),
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_costs": "1,1,1,0;1,1,1,0"}, 2,
     "parallel.schedule_costs", "parallel.schedule_costs='1,1,1,0;1,1,1,0'",
     ["one F,I,W per rank separated by ';'"]),
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_placement": "w"}, 2,
     "parallel.schedule_placement", "parallel.schedule_placement='w'",
     ["must be auto, looped, interleaved, v"]),
    ({**PP2, "parallel.schedule": "search", "parallel.pp": "4",
      "parallel.schedule_placement": "v"}, 4, "parallel.schedule_placement",
     "parallel.schedule_placement='v'", ["needs 2 x pp = 8 layers, the model has 4"]),
    ({**PP2, "parallel.schedule_placement": "v"}, 2, "parallel.schedule_placement",
     "parallel.schedule_placement='v'", ["only schedule = \"search\" takes a placement"]),
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_memory_limit": "0.5"}, 2,
     "parallel.schedule_memory_limit", "parallel.schedule_memory_limit=0.5", [">= 1 unit"]),
    ({**PP2, "parallel.schedule": "search", "parallel.chunks": "2"}, 2, "parallel.chunks",
     "parallel.chunks=2", ["the search chooses the placement"]),
    # vocabulary parallelism across pp x tp: the rows split evenly over every rank of a pipeline
    ({**PP2, "parallel.vocab_parallel_pp": "true", "parallel.tp": "2", "model.preset": "debug",
      "model.vocab_size": "322"}, 4, "model.vocab_size", "model.vocab_size=322",
     ["divisible by parallel.pp x parallel.tp = 2 x 2", "nearest: 320"]),
]


@pytest.mark.parametrize("overrides, world_size, field_name, field_and_value, rule_words",
                         REJECTED, ids=[f"{i:02d}-{case[2]}" for i, case in enumerate(REJECTED)])
def test_bad_pipeline_config_is_refused(overrides, world_size, field_name, field_and_value,
                                        rule_words) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(load_config(None, overrides), world_size)
    message = str(info.value)
    assert info.value.field_name == field_name, message
    assert field_and_value in message
    for words in rule_words:
        assert words in message, f"{words!r} not in {message!r}"


def test_a_schedule_without_a_pipeline_is_refused() -> None:
    for name in ("gpipe", "zbv", "search"):
        with pytest.raises(ConfigError) as err:
            resolve(load_config(None, {"parallel.schedule": name}), 1)
        assert err.value.field_name == "parallel.schedule"
        assert f"parallel.schedule={name!r}: needs parallel.pp > 1" in str(err.value)
    with pytest.raises(ConfigError, match="unknown schedule"):  # a wrong name still comes first
        resolve(load_config(None, {"parallel.schedule": "gpip"}), 1)
    with pytest.raises(ConfigError, match=r"parallel.chunks=5: needs parallel.pp > 1"):
        resolve(load_config(None, {"parallel.chunks": "5"}), 1)


@pytest.mark.parametrize("overrides, world_size", [
    (PP2, 2),
    ({**PP2, "parallel.schedule": "zbv"}, 2),
    ({**PP2, "parallel.schedule": "zbv", "parallel.chunks": "2"}, 2),
    ({**PP2, "parallel.schedule": "interleaved-1F1B", "parallel.chunks": "2"}, 4),
    ({**PP2, "parallel.schedule": "dualpipev"}, 2),  # m = 8 >= 2p
    ({**PP2, "parallel.pp": "4", "model.n_layers": "8", "parallel.schedule": "v_min"}, 8),
    # Tied embeddings across stages (tests/dist/test_pipeline_tied.py).
    ({**PP2, "model.tie_embeddings": "true"}, 2),
    ({**PP2, "model.tie_embeddings": "true", "parallel.schedule": "zbv"}, 2),
    ({**PP2, "model.tie_embeddings": "true", "parallel.tp": "2",
      "parallel.vocab_parallel": "true"}, 4),
    ({**PP2, "model.tie_embeddings": "true", "parallel.dp_shard": "2",
      "parallel.reshard_after_forward": "false"}, 4),
    ({**PP2, "parallel.schedule": "search"}, 2),
    # vocabulary parallelism across the pipeline composed with tp (and with dp_replicate too)
    ({**PP2, "parallel.vocab_parallel_pp": "true", "parallel.tp": "2", "model.preset": "debug"},
     4),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "parallel.tp": "2", "model.preset": "debug",
      "parallel.schedule": "zbv", "model.tie_embeddings": "true",
      "parallel.dp_replicate": "2", "train.global_batch_size": "16"}, 8),
    # ... and with ZeRO on dp_shard, every stage, HSDP too (tests/dist/test_vocab_pp_zero.py)
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug",
      "parallel.dp_shard": "2", "parallel.zero_stage": "1"}, 4),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug",
      "parallel.dp_shard": "2", "parallel.zero_stage": "3"}, 4),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug",
      "parallel.dp_shard": "2", "parallel.dp_replicate": "2", "parallel.zero_stage": "2",
      "train.global_batch_size": "16"}, 8),
    # ... and with cp, every cp_mode (each cp coordinate's pipeline runs its own tokens' passes;
    # the rows reduced over dp x cp: tests/dist/test_vocab_pp_cp.py), ZeRO and tp too
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug", "parallel.cp": "2"},
     4),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug", "parallel.cp": "2",
      "parallel.cp_mode": "ulysses", "parallel.schedule": "zbv"}, 4),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug", "parallel.cp": "2",
      "parallel.dp_shard": "2", "parallel.zero_stage": "3"}, 8),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug", "parallel.cp": "2",
      "parallel.tp": "2", "parallel.sequence_parallel": "true"}, 8),
    # ... and on documents, packed or varlen (tests/dist/test_documents_axes.py)
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug",
      "data.packing": "pack"}, 2),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "model.preset": "debug", "parallel.cp": "2",
      "data.packing": "varlen"}, 4),
    # tied embeddings across stages under cp and with an MoE model (test_pipeline_tied.py)
    ({**PP2, "model.tie_embeddings": "true", "parallel.cp": "2"}, 4),
    ({**PP2, "model.tie_embeddings": "true", "model.preset": "tiny-moe"}, 2),
    ({**PP2, "model.tie_embeddings": "true", "parallel.dp_shard": "2",
      "parallel.zero_stage": "1"}, 4),
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_memory_limit": "3",
      "parallel.schedule_costs": "1,1,0.5,0.05"}, 2),
    # sequence parallelism under schedules that split the backward into I and W, vocabulary
    # parallelism across the pipeline too (tests/dist/test_pipeline_split_sp.py)
    ({**PP2, "parallel.tp": "2", "parallel.sequence_parallel": "true",
      "parallel.schedule": "zb_h2"}, 4),
    ({**PP2, "parallel.vocab_parallel_pp": "true", "parallel.tp": "2", "model.preset": "debug",
      "parallel.sequence_parallel": "true", "parallel.schedule": "zbv"}, 4),
    # per-rank costs (the planner writes these) and a pinned placement
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_placement": "looped",
      "parallel.schedule_costs": "0.9,1,0.6;1,1.2,0.7,0.02"}, 2),
    ({**PP2, "parallel.schedule": "search", "parallel.schedule_placement": "v"}, 2),
    # With pp = 1 there is no schedule to run: only the default family, in any spelling (another
    # family or a chunk count is refused, test_a_schedule_without_a_pipeline_is_refused).
    ({"parallel.schedule": "1F1B"}, 1),
])
def test_valid_pipeline_configs_resolve(overrides, world_size) -> None:
    config = resolve(load_config(None, overrides), world_size)
    par = config.parallel
    assert par.pp * par.dp * par.tp * par.cp == world_size


def test_defaults_are_1f1b_with_the_family_chunks() -> None:
    config = load_config(None, {})
    assert (config.parallel.schedule, config.parallel.chunks) == ("1f1b", 0)


def test_search_picks_a_schedule_within_its_memory_limit() -> None:
    """The searched schedule is the search's best for the config's costs and limit, and every
    caller (config rules, trainer, memory estimator) gets the same one."""
    from loom.schedule.select import schedule_for
    from loom.schedule.validate import peak_memory

    tight = schedule_for("search", 4, 8, memory_limit=2, costs="1,1,1,0")
    loose = schedule_for("search", 4, 8, memory_limit=8, costs="1,1,1,0")
    assert max(peak_memory(tight)) <= 2 + 1e-9 and max(peak_memory(loose)) <= 8 + 1e-9
    assert schedule_for("search", 4, 8, memory_limit=2, costs="1,1,1,0") is tight
    assert tight.name.startswith("search")
