"""``loom plan --sites``: a layout's replicas over slow links under each dp_mode
(``loom.sim.outer_cost``, on the link formulas of ``loom.formulas.outer``)."""

import dataclasses
import json

import pytest

from loom.cli import main
from loom.formulas.outer import ring_all_reduce_time_s
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import LINKS, make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.outer_cost import Sites, price_modes, recommend, replica_step

LAYOUT = Layout(dp_replicate=4, dp_shard=16, zero_stage=3, microbatches=8)


def model() -> CostModel:
    return CostModel(PRESETS["llama3-8b"], 8192, 512, make_cluster("H100-SXM", 64, 8))


def sites(link: str = "wan-1gbit") -> Sites:
    return Sites(2, LINKS[link].bandwidth, LINKS[link].latency, link)


def test_one_replicas_step_is_the_same_layout_as_a_job_of_its_own():
    alone = CostModel(PRESETS["llama3-8b"], 8192, 128, make_cluster("H100-SXM", 16, 8))
    expected = alone.evaluate(Layout(dp_shard=16, zero_stage=3, microbatches=8))
    assert replica_step(model(), LAYOUT).step_time == pytest.approx(expected.step_time)


def test_outer_modes_pay_their_synchronisation_once_per_h_steps():
    m = model()
    inner, costs = price_modes(m, LAYOUT, sites(), outer_steps=(8, 32))
    by = {(c.mode, c.outer_steps): c for c in costs}
    bandwidth = LINKS["wan-1gbit"].bandwidth / 32  # the uplink shared by a site's 32 GPUs
    message = 4 * m.stepped_parameters(LAYOUT)  # fp32 pseudo-gradients of its ZeRO slice
    outer = ring_all_reduce_time_s(message, 4, bandwidth, LINKS["wan-1gbit"].latency)
    for h in (8, 32):
        assert by["diloco", h].exposed == pytest.approx(outer / h)
        assert by["diloco", h].step_time == pytest.approx(inner.step_time + outer / h)
        assert by["noloco", h].exposed < by["diloco", h].exposed  # one peer, not a ring
        assert by["co2", h].exposed == pytest.approx(max(0.0, outer - h * inner.step_time) / h)
    assert by["diloco", 32].bytes_per_step == pytest.approx(by["diloco", 8].bytes_per_step / 4)


def test_sync_hides_its_all_reduce_behind_the_backward_only():
    inner, costs = price_modes(model(), LAYOUT, sites("wan-100gbit"))
    sync = costs[0]
    assert sync.mode == "sync" and sync.exposed == pytest.approx(
        max(0.0, sync.link_busy - inner.compute * 2 / 3))


def test_the_recommendation_is_sync_when_the_sites_are_close_else_the_smallest_h_that_pays():
    fast = price_modes(model(), LAYOUT, Sites(2, 1e15, 0.0))
    assert recommend(*fast).mode == "sync"
    inner, costs = price_modes(model(), LAYOUT, sites("wan-10gbit"), outer_steps=(8, 32, 128))
    chosen = recommend(inner, costs)
    assert chosen.mode != "sync" and chosen.step_time <= 1.1 * inner.step_time
    assert all(c.outer_steps >= chosen.outer_steps for c in costs[1:]
               if c.step_time <= 1.1 * inner.step_time)


def test_each_outer_mode_carries_its_state_in_memory_and_is_recommended_only_if_it_fits():
    """An outer loop keeps an fp32 snapshot and momentum of the parameters a rank steps (co2
    also its displacement and pending average): 8 and 16 bytes each over one replica's step.
    On an accelerator with just enough memory for sync, the outer modes are not recommended
    even where the link makes them faster."""
    m = model()
    lay = dataclasses.replace(LAYOUT, recompute="full")  # LAYOUT itself needs 99 GB of 80
    inner, costs = price_modes(m, lay, sites("wan-1gbit"), outer_steps=(8, 32))
    stepped = m.stepped_parameters(lay)
    for cost in costs:
        extra = {"sync": 0, "diloco": 8, "noloco": 8, "co2": 16}[cost.mode] * stepped
        assert cost.memory == pytest.approx(inner.memory_total + extra)
        assert cost.fits
    assert recommend(inner, costs).mode != "sync"  # a slow link: an outer mode pays
    tight = [dataclasses.replace(c, fits=c.mode == "sync") for c in costs]
    assert recommend(inner, tight).mode == "sync"
    # the mode's own memory decides it against the accelerator's
    small = dataclasses.replace(m.cluster.gpu, memory_bytes=inner.memory_total + 4 * stepped)
    shrunk = CostModel(m.model, m.seq, m.batch, dataclasses.replace(m.cluster, gpu=small))
    _, on_small = price_modes(shrunk, lay, sites("wan-1gbit"), outer_steps=(8,))
    assert [c.fits for c in on_small] == [True, False, False, False]


def test_replicas_must_split_evenly_over_the_sites():
    with pytest.raises(ValueError, match="multiple of the 3"):
        price_modes(model(), LAYOUT, Sites(3, 1e9, 0.0))


ARGS = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "H100-SXM", "--seq", "8192",
        "--global-batch-tokens", "4194304"]


def test_cli_prints_each_mode_and_recommends_one(capsys):
    assert main(ARGS + ["--sites", "2", "--site-link", "wan-10gbit", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["sites"]
    assert table["sites"] == 2 and table["link"] == "wan-10gbit"
    assert {m["mode"] for m in table["modes"]} == {"sync", "diloco", "noloco", "co2"}
    assert sum(m["recommended"] for m in table["modes"]) == 1


@pytest.mark.parametrize("extra,named", [
    (["--sites", "1"], "--sites 1"),
    (["--sites", "2", "--site-link", "carrier-pigeon"], "--site-link carrier-pigeon"),
    (["--sites", "2", "--outer-steps", "8,x"], "--outer-steps 8,x"),
])
def test_cli_refuses_bad_sites_by_name(extra, named, capsys):
    assert main(ARGS + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"loom plan: {named}") and "\n" not in err
