"""Accelerators the planner prices for published runs beside the trainer's catalog
(``loom.plan.hardware.VARIANTS``: a power-capped H100, V100s), the topology flags of
``loom plan``, and the rank order that decides which groups cross a rack or a pod.

A power-capped part keeps its nominal peak (MFU is reported against it) but sustains a
fraction of it in matmuls, known only within a range that widens the uncertainty band. The
topology flags describe the network as a ``--hardware`` file's ``[cluster]`` table does and win
over it; bad values are refused with the flag and the rule, exit 2, on one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.cli import main
from loom.plan.hardware import GB, GPUS, VARIANTS, load_catalog, make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS, RANK_ORDER
from loom.sim.uncertainty import band

LLAMA_8B = PRESETS["llama3-8b"]
LLAMA3_ORDER = ("tp", "cp", "pp", "ep", "dp_shard", "dp_replicate")  # "[TP, CP, PP, DP]"
LLAMA3_NETWORK = {"nodes_per_rack": 2, "racks_per_pod": 192, "spine_oversubscription": 7}


# ----- the variants -------------------------------------------------------------------------

def test_the_h800_computes_as_an_h100_and_talks_slower_inside_its_node():
    """The H800 SXM is the H100 SXM's die with NVLink cut to 400 GB/s both ways: the same
    matmuls, a tp8 all-reduce 450/200 times longer, and the same network between nodes."""
    h800, h100 = make_cluster("H800", 16), make_cluster("H100-SXM", 16)
    assert h800.gpu.peak_flops == h100.gpu.peak_flops and h800.gpu.memory_bytes == 80 * 2**30
    assert h800.intra.bandwidth == 200 * GB and h800.inter is h100.inter
    lay = Layout(dp_replicate=2, tp=8, micro_batch=1, microbatches=4)
    comm = {name: CostModel(LLAMA_8B, 4096, 8, c).evaluate(lay).comm["tp"]
            for name, c in (("h800", h800), ("h100", h100))}
    assert comm["h800"] > 2 * comm["h100"]


def test_the_variants_are_priced_but_not_in_the_trainers_table():
    assert not set(VARIANTS) & set(GPUS)
    catalog = load_catalog()[0]
    for name in VARIANTS:
        assert catalog[name] is VARIANTS[name]
        assert make_cluster(name, 16).gpu is VARIANTS[name]


def test_a_power_capped_h100_keeps_its_nominal_peak_and_sustains_a_fraction_of_it():
    capped, full = VARIANTS["H100-SXM-500W"], GPUS["H100-SXM"]
    assert capped.peak_flops == full.peak_flops  # MFU stays against 989 TFLOP/s
    assert capped.memory_bytes == 96 * 2**30 and capped.hbm_bandwidth == 2400 * GB
    for dim in (64, 1024, 16384):
        assert capped.matmul_rate(dim) == pytest.approx(0.8 * full.matmul_rate(dim))
    low, high = capped.step_spread  # the clock's range 0.67-0.90 around 0.8
    assert low == pytest.approx(0.8 / 0.9) and high == pytest.approx(0.8 / 0.67)
    assert full.step_spread == (1.0, 1.0)


def test_the_cap_prices_matmuls_as_a_lower_peak_would_and_nothing_else():
    """Same layout on the capped part, on the same part uncapped, and on the uncapped part with
    0.8 of the peak: the cap is the lower peak's step exactly, slower than uncapped."""
    capped = VARIANTS["H100-SXM-500W"]
    uncapped = dataclasses.replace(capped, power_fraction=1.0, power_fraction_range=())
    lower_peak = dataclasses.replace(uncapped, peak_flops=0.8 * capped.peak_flops)
    base = make_cluster("H100-SXM-500W", 8)
    lay = Layout(dp_shard=8, zero_stage=3, micro_batch=1, microbatches=2)
    steps = {}
    for name, gpu in (("capped", capped), ("uncapped", uncapped), ("lower", lower_peak)):
        cluster = dataclasses.replace(base, gpu=gpu)
        steps[name] = CostModel(LLAMA_8B, 4096, 16, cluster).evaluate(lay)
    assert steps["capped"].compute == pytest.approx(steps["lower"].compute, rel=1e-12)
    assert steps["capped"].step_time == pytest.approx(steps["lower"].step_time, rel=1e-12)
    assert steps["capped"].step_time > steps["uncapped"].step_time
    assert steps["capped"].model_flops == steps["uncapped"].model_flops


def test_v100_entries_carry_their_nodes_and_links():
    dgx2 = make_cluster("V100-SXM3-32GB", 512)
    assert (dgx2.gpus_per_node, dgx2.intra.name, dgx2.inter.name) == (16, "nvswitch2",
                                                                       "edr-ib-x2")
    assert dgx2.inter.bandwidth == 100 * GB / 16  # 100 GB/s per server over 16 GPUs
    assert dgx2.gpu.peak_flops == 130e12 and dgx2.gpu.memory_bytes == 32 * 2**30
    dgx1 = make_cluster("V100-SXM2-32GB", 64)
    assert (dgx1.gpus_per_node, dgx1.intra.bandwidth, dgx1.gpu.peak_flops) == (8, 150 * GB,
                                                                               125e12)


@pytest.mark.parametrize("changes, field", [
    ({"power_fraction": 0.0}, "power_fraction"),
    ({"power_fraction": 1.2}, "power_fraction"),
    ({"power_fraction": 0.8, "power_fraction_range": (0.85, 0.9)}, "power_fraction_range"),
    ({"power_fraction": 0.8, "power_fraction_range": (0.7,)}, "power_fraction_range"),
])
def test_a_bad_power_fraction_is_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(GPUS["H100-SXM"], **changes)


def test_a_hardware_file_may_describe_a_capped_part(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('[gpu.capped]\npeak_flops = 400e12\nmemory_gb = 96\nhbm_gbps = 3000\n'
                    'power_fraction = 0.75\npower_fraction_range = [0.6, 0.9]\n')
    gpu = make_cluster("capped", 8, 8, catalog=load_catalog(path)).gpu
    assert gpu.power_fraction_range == (0.6, 0.9)
    assert gpu.step_spread == pytest.approx((0.75 / 0.9, 0.75 / 0.6))


@pytest.mark.parametrize("step", [0.01, 3.0, 90.0])
def test_the_clocks_range_widens_the_band_on_both_sides(step):
    plain = band(step)
    wide = band(step, hardware=VARIANTS["H100-SXM-500W"].step_spread)
    assert wide[0] < plain[0] <= step <= plain[1] < wide[1]
    with pytest.raises(ValueError, match="hardware spread"):
        band(step, hardware=(1.1, 1.2))


def test_the_plan_of_a_capped_part_reports_the_wider_band(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096",
            "--global-batch-tokens", str(16 * 4096), "--layout",
            "dp_shard=8,zero_stage=3,micro_batch=1,microbatches=2", "--json"]
    bands = {}
    for gpu in ("H100-SXM", "H100-SXM-500W"):
        assert main([*args, "--gpu", gpu]) == 0
        row = json.loads(capsys.readouterr().out)["ranked"][0]
        low, high = row["step_band_s"]
        bands[gpu] = (high - low) / row["step_time_s"]
    assert bands["H100-SXM-500W"] > bands["H100-SXM"]


def test_a_hardware_files_cluster_gpu_is_the_default_accelerator(capsys, tmp_path):
    """The catalog's documented ``[cluster] gpu`` is what a plan prices when --gpu is not
    given (the flag's own default once hid it); --gpu still wins over it."""
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096",
            "--global-batch-tokens", str(16 * 4096), "--layout",
            "dp_shard=8,zero_stage=3,micro_batch=1,microbatches=2", "--json"]
    path = tmp_path / "hw.toml"
    path.write_text('[cluster]\ngpu = "A100-80GB"\n')
    steps = {}
    for name, extra in [("H100", []), ("A100", ["--gpu", "A100-80GB"]),
                        ("file", ["--hardware", str(path)]),
                        ("flag wins", ["--hardware", str(path), "--gpu", "H100-SXM"])]:
        assert main([*args, *extra]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]
    assert steps["file"] == steps["A100"] > steps["H100"] == steps["flag wins"]
    path.write_text("[cluster]\ngpu = 5\n")
    assert main([*args, "--hardware", str(path)]) == 2
    assert "[cluster] gpu = 5: must be an accelerator's name" in capsys.readouterr().err


# ----- topology flags -----------------------------------------------------------------------

PLAN = ["plan", "--model", "llama3-8b", "--gpus", "64", "--seq", "4096",
        "--global-batch-tokens", str(64 * 4096), "--layout",
        "dp_replicate=64,micro_batch=1,microbatches=1", "--json"]


def _step(capsys, *extra: str) -> float:
    assert main([*PLAN, *extra]) == 0
    return json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]


def test_topology_flags_price_the_network_they_describe(capsys):
    flat = _step(capsys)
    assert _step(capsys, "--nodes-per-rack", "2") == flat  # non-blocking racks: no change
    racked = _step(capsys, "--nodes-per-rack", "2", "--rack-oversubscription", "7")
    assert racked > flat
    # one rack of all 8 nodes: the ratio never applies
    assert _step(capsys, "--nodes-per-rack", "8", "--rack-oversubscription", "7") == flat


def test_topology_flags_win_over_the_hardware_file(tmp_path, capsys):
    path = tmp_path / "hw.toml"
    path.write_text("[cluster]\nnodes_per_rack = 2\nrack_oversubscription = 7\n")
    from_file = _step(capsys, "--hardware", str(path))
    assert from_file == _step(capsys, "--nodes-per-rack", "2", "--rack-oversubscription", "7")
    assert _step(capsys, "--hardware", str(path), "--rack-oversubscription", "1") < from_file


@pytest.mark.parametrize("flags, named", [
    (["--nodes-per-rack", "-1"], "--nodes-per-rack -1: must be a whole number >= 0"),
    (["--nodes-per-rack", "2.5"], "--nodes-per-rack 2.5: must be a whole number >= 0"),
    (["--racks-per-pod", "x"], "--racks-per-pod x: must be a whole number >= 0"),
    (["--rack-oversubscription", "0.5"],
     "--rack-oversubscription 0.5: must be a number in [1, 1000]"),
    (["--spine-oversubscription", "nan"],
     "--spine-oversubscription nan: must be a number in [1, 1000]"),
    (["--spine-oversubscription", "inf"],
     "--spine-oversubscription inf: must be a number in [1, 1000]"),
    # a link's bandwidth over 1e308 underflowed to 0, which the link's own check raised on
    (["--nodes-per-rack", "1", "--rack-oversubscription", "1e308"],
     "--rack-oversubscription 1e308: must be a number in [1, 1000]"),
    (["--racks-per-pod", "4"], "--racks-per-pod 4: needs --nodes-per-rack > 0"),
    # a zero taken as "not given", a flag ignored without --sites: refused, before the search
    (["--seq", "0"], "--seq 0: must be >= 1"),
    (["--outer-steps", "0"], "--outer-steps 0: integers >= 1"),
    (["--outer-steps", "8,x"], "--outer-steps 8,x: integers >= 1"),
])
def test_bad_topology_flags_are_refused_on_one_line(flags, named, capsys):
    assert main([*PLAN, *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1


# ----- the rank order -------------------------------------------------------------------------

def test_the_default_rank_order_is_looms_grid():
    degrees = {"tp": 8, "cp": 2, "ep": 1, "dp_shard": 4, "dp_replicate": 3, "pp": 5}
    loom = FRAMEWORKS["loom"]
    assert loom.rank_order == RANK_ORDER
    assert loom.stride(degrees, "tp") == 1
    assert loom.stride(degrees, "cp") == 8
    assert loom.stride(degrees, "dp_shard", "cp", "ep") == 8  # ZeRO's shard group over dp x cp
    assert loom.stride(degrees, "dp_replicate") == 8 * 2 * 4
    assert loom.stride(degrees, "pp") == 8 * 2 * 4 * 3
    llama3 = dataclasses.replace(loom, rank_order=LLAMA3_ORDER)
    assert llama3.stride(degrees, "pp") == 8 * 2
    assert llama3.stride(degrees, "dp_shard", "cp", "ep") == 8 * 5  # cp inside, pp between
    with pytest.raises(ValueError, match="rank_order"):
        dataclasses.replace(loom, rank_order=("tp", "pp"))


def test_the_rank_order_decides_which_groups_cross_the_pods():
    """Llama 3 405B on 8,192 GPUs of its network: with the pipeline outermost (Loom's grid)
    stages of 512 GPUs meet at the pods' edges and their sends queue on the 1:7 aggregation
    layer; with "[TP, CP, PP, DP]" a pipeline spans 128 GPUs inside a pod, and the FSDP
    groups that cross the pods leave them on one stream per 24 members, within capacity."""
    model = PRESETS["llama3-405b"]
    lay = Layout(pp=16, dp_shard=64, tp=8, zero_stage=2, schedule="interleaved_1f1b",
                 chunks=2, micro_batch=1, microbatches=32)
    flat = make_cluster("H100-SXM", 8192, 8, inter="roce-400")
    llama3_net = make_cluster("H100-SXM", 8192, 8, inter="roce-400", network=LLAMA3_NETWORK)
    stack = FRAMEWORKS["torchtitan"]
    ordered = dataclasses.replace(stack, rank_order=LLAMA3_ORDER)

    def comm(cluster, framework):
        return CostModel(model, 8192, 2048, cluster, framework=framework).evaluate(lay).comm

    assert comm(llama3_net, ordered) == comm(flat, ordered) == comm(flat, stack)
    across = comm(llama3_net, stack)
    assert across["pp"] > comm(flat, stack)["pp"] and across["dp"] == comm(flat, stack)["dp"]
