"""bench/planner_published.toml's tune / holdout split and its report (issue 21), and the
uncertainty band every prediction carries (``loom.sim.uncertainty``)."""

from __future__ import annotations


import pytest

from loom.sim.frameworks import FRAMEWORKS
from loom.sim.uncertainty import TUNE_RATIO_HIGH, TUNE_RATIO_LOW, band, overlapping
from tests.conftest import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("planner_published")


def test_every_row_has_a_split_by_the_stated_rule_and_a_known_profile(bench):
    rows = bench.load_rows()
    assert len(rows) >= 36
    rule = bench.split_by_rule(rows)
    for row in rows:
        assert row["split"] == rule[row["name"]], row["name"]
        assert row["framework"] in FRAMEWORKS, row["name"]
        bench.framework_of(row)  # the overlap overrides name real knobs
    halves = [r["split"] for r in rows if bench.skip_reason(r) is None]
    assert halves.count("tune") >= 10 and halves.count("holdout") >= 10


def test_the_split_report_runs_on_published_rows(bench):
    """Two cheap rows, one per half (no pipeline): the report counts them apart."""
    rows = {r["name"]: r for r in bench.load_rows()}
    picked = [rows["megatron2021-t1-1.7b-32gpu"], rows["torchtitan-llama3-70b-a100-64gpu-fsdp"]]
    assert [r["split"] for r in picked] == ["tune", "holdout"]
    results = [bench.compare(r, search=False) for r in picked]
    report = bench.split_report(results)
    assert report["tune"]["rows"] == report["holdout"]["rows"] == 1
    for half, result in zip(("tune", "holdout"), results):
        within = abs(result["ratio"] - 1) <= 0.10
        assert report[half]["within_10pct"] == int(within)
        assert report[half]["median_ratio"] == result["ratio"]
        assert report[half]["judged_oom"] == ([result["name"]] if result["oom"] else [])
    assert "| tune | 1 |" in bench.format_split_report(report)


def test_rows_added_after_the_split_are_held_out_and_move_no_earlier_row(bench):
    rows = bench.load_rows()
    added = [r for r in rows if r.get("added_after_split")]
    assert len(added) >= 20
    assert {r["split"] for r in added} == {"holdout"}
    assert all(r["source"] and r["source_file"] for r in added)
    earlier = [r for r in rows if not r.get("added_after_split")]
    rule_without = bench.split_by_rule(earlier)
    assert all(rule_without[r["name"]] == r["split"] for r in earlier)


def test_a_cell_published_as_out_of_memory_is_scored_by_the_verdict(bench):
    """Narayanan et al. 2021's 530B under ZeRO-3 at microbatch 4 did not fit on 560 GPUs; the
    row has no throughput, and the report counts its out-of-memory verdict."""
    rows = {r["name"]: r for r in bench.load_rows()}
    cell = bench.compare(rows["megatron2021-t2-530b-zero3-560gpu-oom"], search=False)
    assert cell["published_oom"] and cell["ratio"] is None
    assert cell["oom_right"] == cell["oom"]
    ran = bench.compare(rows["megatron2021-t1-1.7b-32gpu"], search=False)
    report = bench.split_report([cell, ran])
    assert report["holdout"]["rows"] == 0 and report["holdout"]["oom_verdicts"] == 1
    assert report["holdout"]["oom_verdicts_right"] == int(cell["oom"])
    assert report["tune"]["oom_verdicts_right"] == int(not ran["oom"])
    assert "OOM verdict right" in bench.format_split_report(report)


def test_the_open_knobs_are_those_the_run_could_have_used(bench):
    """Sequence parallelism is open only with tensor parallelism and from 2022 on (or on
    TorchTitan, whose tensor parallelism always shards the norms); recomputation only where
    the row does not state it; Megatron's distributed optimizer (ZeRO-1) on a Megatron stack
    with data parallelism from 2023 on, where the row names no sharding."""
    rows = {r["name"]: r for r in bench.load_rows()}
    assert bench.published_year(rows["llama3-405b-8192gpu-seq8k"]) == 2024  # arXiv 2407.x
    assert bench.published_year(rows["megatron2021-t1-1.7b-32gpu"]) == 2021
    # NVIDIA's container tags are year.month
    assert bench.published_year(rows["nemo-24.07-gpt3-175b-h100-512gpu-fp8"]) == 2024
    assert bench.published_year(rows["megatron-bridge-26.02-llama3-70b-h100-64gpu-fp8"]) == 2026
    assert bench.unstated_choices(rows["megatron2021-t1-145.6b-1536gpu"]) == {}  # tp8, 2021
    every = {"sequence_parallel": (False, True), "recompute": ("none", "selective", "full"),
             "zero_stage": (0, 1)}
    assert bench.unstated_choices(rows["megascale2024-megatron-baseline-175b-256gpu"]) == every
    assert bench.unstated_choices(rows["megatron-bridge-26.02-llama3-70b-h100-64gpu-fp8"]) == every
    # 2022, data parallel: before the distributed optimizer; its SP and recomputation stated
    assert bench.unstated_choices(rows["korthikanti2022-mtnlg-530b-2240gpu-dp8-sp-selective"]) \
        == {}
    # a stated sharding is not open: BLOOM's ZeRO-1 (DeepSpeed), Narayanan's ZeRO-3 cells
    assert "zero_stage" not in bench.unstated_choices(rows["bloom-176b-384gpu-tp4-pp12-dp8"])
    # stated: "without activation checkpointing"
    assert bench.unstated_choices(rows["llama3-405b-8192gpu-seq8k"]) == {
        "sequence_parallel": (False, True)}
    assert bench.unstated_choices(rows["korthikanti2022-1t-512gpu-full-recompute"]) == {}
    assert bench.unstated_choices(rows["torchtitan-llama3-8b-a100-64gpu-fsdp"]) == {}  # tp 1


def test_a_run_is_priced_with_the_fastest_open_setting_that_fits(bench):
    """MegaScale's Megatron baseline states neither sequence parallelism, recomputation nor
    the distributed optimizer. All off, the model judges it out of memory; the run ran, so it
    is priced as its user would have run it: the fastest setting of the three that fits."""
    row = {r["name"]: r for r in bench.load_rows()}["megascale2024-megatron-baseline-175b-256gpu"]
    result = bench.compare(row, search=False)
    assert not result["oom"]
    every = []
    for zero in (0, 1):
        for sp in (False, True):
            for recompute in ("none", "selective", "full"):
                forced = {**row, "layout": {**row["layout"], "sequence_parallel": sp,
                                            "recompute": recompute, "zero_stage": zero}}
                every.append(bench.compare(forced, search=False))
    assert every[0]["oom"]  # all off: out of memory
    fitting = [r for r in every if not r["oom"]]
    fastest = min(fitting, key=lambda r: r["predicted_step_s"])
    assert result["predicted_step_s"] == fastest["predicted_step_s"]
    assert result["layout"] == fastest["layout"]
    assert "sequence parallel" in result["assumed"]


def test_a_run_that_states_its_knobs_is_priced_as_stated(bench):
    """Narayanan et al.'s ZeRO-3 cell states its knobs; with none open it is priced as
    stated, and its out-of-memory verdict stands."""
    row = {r["name"]: r for r in bench.load_rows()}["megatron2021-t2-530b-zero3-560gpu-oom"]
    assert bench.unstated_choices(row) == {}
    assert bench.compare(row, search=False)["oom"]


def test_a_torchtitan_pipeline_run_takes_torchtitan_s_microbatch_default(bench):
    """torchtitan splits a rank's batch into as many microbatches as pipeline ranks unless
    told otherwise: its 405B run (local batch 32, pp 8, no microbatch stated) is priced with
    8 microbatches of 4. Llama 3's rows, priced with torchtitan's profile but not run on it,
    keep Megatron's default of micro batch 1."""
    rows = {r["name"]: r for r in bench.load_rows()}
    layout, assumed = bench.layout_of(
        rows["torchtitan-llama3.1-405b-h100-512gpu-fsdp8-tp8-pp8-float8"])
    assert (layout.micro_batch, layout.microbatches) == (4, 8)
    assert "8 microbatches of 4 (torchtitan's default)" in assumed
    layout, assumed = bench.layout_of(rows["llama3-405b-8192gpu-seq8k"])
    assert layout.micro_batch == 1 and "micro batch 1" in assumed


def test_tokens_per_second_is_compared_where_published(bench):
    """Tokens/s counts the same thing on both sides; an MFU is the stack's own FLOP count
    (torchtitan's includes the embedding, 5% more than Loom's). A row that publishes both is
    compared in tokens/s; a row with only an MFU (Llama 3) keeps it."""
    rows = {r["name"]: r for r in bench.load_rows()}
    row = rows["torchtitan-llama3-8b-a100-64gpu-fsdp"]
    assert {"mfu", "tokens_per_s_per_gpu"} <= set(row["reported"])
    result = bench.compare(row, search=False)
    assert result["metric"] == "tokens/s/GPU" and result["published"] == 2973
    tokens = 64 * 8192 / result["predicted_step_s"] / 64
    assert result["ratio"] == pytest.approx(2973 / tokens)
    assert bench.compare(rows["llama3-405b-8192gpu-seq8k"], search=False)["metric"] == "MFU"


def test_fp8_rows_are_compared_with_their_linears_in_fp8(bench):
    """A row whose GEMMs ran in FP8 is priced, not skipped: the blocks' linears at the
    accelerator's FP8 peak (faster than the same row in bf16), compared in tokens/s."""
    rows = {r["name"]: r for r in bench.load_rows()}
    for name in ("nemo-24.07-gpt3-175b-h100-512gpu-fp8",
                 "torchtitan-llama3.1-70b-h100-256gpu-fsdp32-tp8-float8"):
        row = rows[name]
        assert bench.skip_reason(row) is None and bench.fp8_of(row)
        fp8 = bench.compare(row, search=False)
        bf16 = bench.compare({**row, "precision": "bf16"}, search=False)
        assert fp8["metric"] == "tokens/s/GPU" and fp8["published"] > 0
        assert fp8["predicted_step_s"] < bf16["predicted_step_s"]
    assert not bench.fp8_of(rows["llama3-405b-8192gpu-seq8k"])


def test_moe_rows_are_priced_with_their_experts_and_megatron_s_expert_parallelism(bench):
    """A Megatron MoE row's "dp 16, EP 16" is Loom's ep 16 beside dp_shard 1 (Megatron's
    expert parallelism lives inside its data parallelism); the model keeps its head size,
    QK-norm and experts; the distributed optimizer shards the dense parameters over the
    expert ranks, so dropping it costs memory."""
    rows = {r["name"]: r for r in bench.load_rows()}
    row = rows["megatron-bridge-26.06-qwen3-30b-a3b-h100-16gpu-fp8-ep16"]
    assert bench.skip_reason(row) is None
    model = bench.model_of(row)
    assert (model.n_experts, model.top_k, model.expert_ffn_dim) == (128, 8, 768)
    assert model.head_dim == 128 != model.dim // model.n_heads and model.qk_norm
    layout, _ = bench.layout_of(row, zero_stage=1)
    assert (layout.ep, layout.dp_shard, layout.dp_replicate) == (16, 1, 1)
    assert layout.microbatches == 1024 // 16
    sharded = bench.compare(row, search=False)
    assert sharded["metric"] == "tokens/s/GPU" and "distributed optimizer" in sharded["assumed"]
    whole = bench.compare({**row, "layout": {**row["layout"], "zero_stage": 0}}, search=False)
    assert whole["memory_gib"] > sharded["memory_gib"]


def test_a_row_that_gathers_its_fp8_weights_in_float8_is_priced_so(bench):
    """Trainy's H200 rows state FSDP2's float8 all-gather: their weights cross the network at
    one byte, so the same row without it communicates more and is no faster."""
    rows = {r["name"]: r for r in bench.load_rows()}
    row = rows["trainy-2025-06-llama3.1-8b-h200-64gpu-fsdp64-float8"]
    assert bench.fp8_all_gather_of(row) and bench.gpu_of(row)[0] == "H200"
    gathered = bench.compare(row, search=False)
    plain = bench.compare({**row, "fp8_all_gather": False}, search=False)
    assert gathered["predicted_step_s"] < plain["predicted_step_s"]
    assert not bench.fp8_all_gather_of({**row, "precision": "bf16"})  # needs FP8 linears


def test_moe_rows_loom_cannot_express_are_skipped_with_the_reason(bench):
    rows = {r["name"]: r for r in bench.load_rows()}
    assert "tensor-parallel" in bench.skip_reason(
        rows["megatron-bridge-26.04.01-qwen3-235b-a22b-h100-256gpu-fp8-tp2-ep32"])
    assert "sliding window" in bench.skip_reason(
        rows["megatron-bridge-26.02-gpt-oss-120b-h100-64gpu-bf16-moe"])
    assert "MLA" in bench.skip_reason(rows["deepseek-v3-671b-moe-2048xh800"])  # on H800s


def test_llama3_rows_are_priced_on_their_stated_network_and_rank_order(bench):
    """The paper's network (2 servers a rack, 192 racks a pod, 1:7 above) and its "[TP, CP,
    PP, DP]" order: the pipeline stays inside a pod, so the row prices as on a flat network,
    and the same network with the pipeline outermost is slower."""
    rows = {r["name"]: r for r in bench.load_rows()}
    row = rows["llama3-405b-8192gpu-seq8k"]
    assert row["topology"]["spine_oversubscription"] == 7 and row["rank_order"][:3] == [
        "tp", "cp", "pp"]
    stated = bench.compare(row, search=False)
    flat = bench.compare({k: v for k, v in row.items() if k != "topology"}, search=False)
    pipeline_outermost = bench.compare({k: v for k, v in row.items() if k != "rank_order"},
                                       search=False)
    assert stated["predicted_step_s"] == pytest.approx(flat["predicted_step_s"], rel=1e-9)
    assert pipeline_outermost["predicted_step_s"] > stated["predicted_step_s"]


@pytest.mark.parametrize("step", [1e-3, 0.5, 12.0, 300.0])
@pytest.mark.parametrize("calibrated", [False, True])
def test_the_band_contains_the_point_estimate(step, calibrated):
    low, high = band(step, calibrated)
    assert low < step < high
    if calibrated:  # the calibration's spread only widens it
        plain = band(step)
        assert low < plain[0] and high > plain[1]


def test_the_band_is_the_tune_halfs_measured_error(bench):
    """The band's constants are the 10th and 90th percentiles of the time ratio over the
    tune half as the bench prices it now (to 3 decimals): a change to the cost model that
    moves them must move the band with it."""
    tune = [bench.compare(r, search=False) for r in bench.load_rows()
            if r["split"] == "tune" and bench.skip_reason(r) is None]
    low, high = bench.deciles([r["ratio"] for r in tune if r["ratio"] is not None])
    assert (round(low, 3), round(high, 3)) == (TUNE_RATIO_LOW, TUNE_RATIO_HIGH)


def test_overlapping_counts_the_layouts_within_the_first_ones_band():
    low, high = band(10.0)
    assert overlapping([10.0]) == 1
    assert overlapping([10.0, 10.0 * 1.01, 10.0 * 2]) == 2
    # a second layout whose band just reaches the first one's high end still overlaps
    assert overlapping([10.0, high * TUNE_RATIO_HIGH * 0.999]) == 2
    assert overlapping([10.0, high * TUNE_RATIO_HIGH * 1.01]) == 1
    assert overlapping([]) == 0
