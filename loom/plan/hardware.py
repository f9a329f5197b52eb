"""The accelerators and links the planner knows: a catalog of datasheet numbers, user-extendable.

A ``Gpu`` is what the cost model divides work by: dense 16-bit peak FLOP/s, memory, HBM bandwidth
(for the memory-bound optimizer step and element-wise ops) and the achievable fraction of peak for
large matmuls. A ``Link`` is one class of connection between two accelerators (alpha-beta: a
latency per message and a per-direction bandwidth per accelerator, times the fraction collective
libraries achieve on it). A ``Cluster`` is N accelerators of one type, K per node, an intra-node
and an inter-node link.

``GPUS`` are the parts Loom's trainer names for its MFU (``loom.train.flops``); ``VARIANTS`` adds
parts priced for published runs: a power-capped H100 (``Gpu.power_fraction``: the share of its
nominal peak it sustains, with the range that estimate is known within) and V100s, each with its
source beside it.

Sources. Peaks are the dense (non-sparse) BF16 tensor-core numbers of ``../shared/REFERENCE.md``
§0 (torchtitan's ``get_peak_flops``, Narayanan et al. 2021 for the A100); MI250X is AMD's datasheet
383 TFLOP/s per module (two GCDs; we count a module as one device). Memory and bandwidth are the
vendors' datasheets. Link bandwidths are per direction per accelerator: NVLink 3/4/5 = 300/450/900
GB/s (600/900/1800 GB/s bidirectional), HDR InfiniBand 200 Gb/s = 25 GB/s and NDR / 400G RoCE
= 50 GB/s per accelerator (one NIC per GPU, as on Selene, Grand Teton and the Llama 3 cluster).
Latencies (5 us inside a node, 10 us across) and the achievable fractions (0.8 of link bandwidth,
``matmul_efficiency`` 0.7-0.75 of peak) are typical NCCL / cuBLAS figures, not datasheet values;
``loom plan --calibrate`` measures them for the local machine, and a TOML file (``--hardware``)
may override any entry or add new ones::

    [gpu.my-gpu]                 # every Gpu field; missing ones are refused by name
    peak_flops = 400e12
    memory_gb = 96
    hbm_gbps = 3000
    [link.my-fabric]
    bandwidth_gbps = 100         # GB/s per direction per accelerator
    latency_us = 8
    [cluster]                    # optional defaults for --gpu / --gpus-per-node / links
    gpu = "my-gpu"
    inter = "my-fabric"
    nodes_per_rack = 16          # optional topology (``Cluster``; ``loom plan --nodes-per-rack``
                                 # and the like win over it); default non-blocking
    rack_oversubscription = 1
    racks_per_pod = 24
    spine_oversubscription = 7
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.errors import InputFileError, loads_toml, read_input_text

GB = 1e9
GiB = 2**30


def _check_numbers(entry: Any, kind: str) -> None:
    """Every field of ``entry`` declared a number (float or int) holds a finite real number of
    that kind (a catalog file or a profile can write "abc", true, nan or 1e999 anywhere); an
    int field takes a whole number. Raises ValueError naming the field."""
    for spec in dataclasses.fields(entry):
        if spec.type not in ("float", "int"):
            continue
        value = getattr(entry, spec.name)
        whole = spec.type == "int"
        try:
            ok = (not isinstance(value, bool) and isinstance(value, (int, float))
                  and math.isfinite(value) and (not whole or float(value).is_integer()))
        except OverflowError:  # an int beyond any float
            ok = False
        if not ok:
            raise ValueError(f"{kind} {entry.name}: {spec.name} must be a finite"
                             f" {'whole ' if whole else ''}number, got {value!r}")


@dataclass(frozen=True)
class Gpu:
    """One accelerator type."""

    name: str
    peak_flops: float  # dense 16-bit FLOP/s
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    matmul_efficiency: float = 0.7  # fraction of peak a large matmul reaches
    matmul_knee: float = 128.0  # smallest GEMM dimension at which efficiency is half its maximum
    intra: str = "nvlink4"  # default link inside a node
    inter: str = "ndr-ib"  # default link between nodes
    gpus_per_node: int = 8
    op_overhead: float = 0.0  # seconds per layer pass (F, I or W) not tied to FLOPs or bytes
    # Host seconds to dispatch and launch one kernel (``loom.sim.launch_cost``: a layer pass
    # takes the longer of its device time and its kernels' host time); 0: not priced, as on a
    # CPU profile, whose host is its device (``op_overhead`` measures the block's fixed cost)
    launch_overhead: float = 0.0
    # Ranks of a node that share ``cores`` processors (a CPU profile: ``gpus_per_node`` processes
    # on fewer cores); 0 means each rank has its own processor, as every accelerator does.
    cores: float = 0.0
    # Framework work a parallel wrapper adds, measured by ``loom plan --calibrate``: entries
    # (wrapper, seconds per layer pass, seconds per step, seconds per token per layer pass),
    # e.g. DTensor dispatch and redistribution copies under "tp".
    framework: tuple = ()
    # Seconds per parameter of one AdamW step, measured by ``loom plan --calibrate`` on one rank
    # alone; 0: priced as 28 bytes per parameter at ``hbm_bandwidth`` (a fused kernel's traffic)
    optimizer_per_param: float = 0.0
    # dense FP8 FLOP/s of the tensor cores (0: no FP8 matmuls; ``loom plan --fp8`` refuses it)
    fp8_flops: float = 0.0
    # Fraction of ``peak_flops`` a power-capped part sustains in large matmuls (its clocks under
    # the cap), and the (low, high) range that fraction is known to within: ``peak_flops`` stays
    # the nominal datasheet number (MFU is reported against it), ``matmul_rate`` is scaled, and
    # the planner's uncertainty band widens by the range (``loom.sim.uncertainty``).
    power_fraction: float = 1.0
    power_fraction_range: tuple = ()
    # streaming multiprocessors (0: not stated): a stack that runs its communication kernels
    # beside a GEMM reserves some of them, and the GEMM runs on the rest
    # (``Framework.tp_overlap_sms``)
    sms: int = 0

    def __post_init__(self) -> None:
        _check_numbers(self, "gpu")
        for key in ("intra", "inter"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"gpu {self.name}: {key} must be a link's name")
        for key in ("framework", "power_fraction_range"):
            if not isinstance(getattr(self, key), (list, tuple)):
                raise ValueError(f"gpu {self.name}: {key} must be a list")
        # a profile read back from JSON holds lists; keep the dataclass hashable
        object.__setattr__(self, "framework", tuple(tuple(entry) for entry in self.framework))
        object.__setattr__(self, "power_fraction_range", tuple(self.power_fraction_range))
        if not 0 < self.power_fraction <= 1:
            raise ValueError(f"gpu {self.name}: power_fraction must be in (0, 1], got"
                             f" {self.power_fraction}")
        span = self.power_fraction_range
        if span and not (len(span) == 2 and 0 < span[0] <= self.power_fraction <= span[1] <= 1):
            raise ValueError(f"gpu {self.name}: power_fraction_range must be (low, high) with"
                             f" 0 < low <= power_fraction <= high <= 1, got {list(span)}")
        if self.cores < 0:
            raise ValueError(f"gpu {self.name}: cores must be >= 0, got {self.cores}")
        if self.sms < 0:
            raise ValueError(f"gpu {self.name}: sms must be >= 0, got {self.sms}")
        for key in ("peak_flops", "memory_bytes", "hbm_bandwidth", "matmul_knee"):
            if getattr(self, key) <= 0:
                raise ValueError(f"gpu {self.name}: {key} must be > 0, got {getattr(self, key)}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"gpu {self.name}: matmul_efficiency must be in (0, 1]")

    def framework_overhead(self, wrappers: tuple[str, ...]) -> tuple[float, float, float]:
        """(seconds per layer pass, seconds per step, seconds per token per layer pass) the
        named wrappers add, summed (an entry without the per-token term has none)."""
        table = {entry[0]: (tuple(entry[1:]) + (0.0, 0.0, 0.0))[:3] for entry in self.framework}
        for stage in ("zero1", "zero2"):  # profiles before ZeRO-1 and ZeRO-2 were probed apart
            if stage not in table and "zero12" in table:
                table[stage] = table["zero12"]
        picked = [table[w] for w in wrappers if w in table]
        return tuple(sum(p[k] for p in picked) for k in range(3))

    def matmul_rate(self, smallest_dim: float) -> float:
        """FLOP/s of a matmul whose smallest dimension is ``smallest_dim``: the efficiency rises
        as d / (d + knee), the usual saturating shape of GEMM throughput against tile occupancy."""
        return (self.peak_flops * self.power_fraction * self.matmul_efficiency * smallest_dim
                / (smallest_dim + self.matmul_knee))

    @property
    def step_spread(self) -> tuple[float, float]:
        """(low, high) factors a predicted step time may be off by from this part's uncertain
        sustained clock alone: (1, 1) for a part at its rated power."""
        if not self.power_fraction_range:
            return 1.0, 1.0
        low, high = self.power_fraction_range
        return self.power_fraction / high, self.power_fraction / low


@dataclass(frozen=True)
class Link:
    """One class of connection: alpha-beta with a per-direction bandwidth per accelerator."""

    name: str
    bandwidth: float  # bytes/s per direction per accelerator
    latency: float  # seconds per message step
    efficiency: float = 0.8  # fraction of ``bandwidth`` collectives reach

    def __post_init__(self) -> None:
        _check_numbers(self, "link")
        if self.bandwidth <= 0 or self.latency < 0 or not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name}: bandwidth > 0, latency >= 0 and efficiency in"
                             " (0, 1] are required")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


# Host time per kernel of an accelerator driven by eager PyTorch (``Gpu.launch_overhead``):
# Loom's block forward + backward at a size where its kernels do nothing (dim 64, 16 tokens,
# one thread), timed on the CPU of the machine this was written on, over the dispatcher's count
# of its kernels (``loom.sim.launch_cost``): 21-27 us per kernel (forward 1.06 ms / 40, backward
# 1.36 ms / 64 in fp32; bf16 1.25 ms / 48 and 1.83 ms / 76), Python, autograd and the
# dispatcher included. A CUDA launch adds cudaLaunchKernel's few microseconds and saves the tiny
# CPU kernel's; a dedicated server core is likely faster than these two shared ones, so 25 us
# leans towards host-bound. Measured on no GPU, fitted to no step time
# (``bench/launch_overhead.py`` repeats the measurement, on a GPU too).
HOST_LAUNCH = 25e-6

# SM counts: NVIDIA's datasheets and architecture whitepapers (A100 108, H100 SXM5 / NVL / H200 /
# H800 132, H100 PCIe 114, B200 148)
GPUS: dict[str, Gpu] = {g.name: dataclasses.replace(g, launch_overhead=HOST_LAUNCH) for g in (
    Gpu("A100-40GB", 312e12, 40 * GiB, 1555 * GB, 0.75, intra="nvlink3", inter="hdr-ib",
        sms=108),
    Gpu("A100-80GB", 312e12, 80 * GiB, 2039 * GB, 0.75, intra="nvlink3", inter="hdr-ib",
        sms=108),
    Gpu("H100-SXM", 989e12, 80 * GiB, 3350 * GB, 0.7, fp8_flops=1979e12, sms=132),
    Gpu("H100-NVL", 835e12, 94 * GB, 3900 * GB, 0.7, fp8_flops=1671e12, sms=132),
    Gpu("H100-PCIe", 756e12, 80 * GiB, 2000 * GB, 0.7, intra="pcie5", gpus_per_node=8,
        fp8_flops=1513e12, sms=114),
    Gpu("H200", 989e12, 141 * GB, 4800 * GB, 0.7, fp8_flops=1979e12, sms=132),
    # H800 SXM: the H100 SXM's die and HBM3 with NVLink cut to 8 links, 400 GB/s both ways
    # (NVIDIA's H800 datasheet; DeepSeek-V3 §3.1 measured about 160 GB/s of it)
    Gpu("H800", 989e12, 80 * GiB, 3350 * GB, 0.7, intra="nvlink4-h800", fp8_flops=1979e12,
        sms=132),
    Gpu("B200", 2.25e15, 180 * GB, 8000 * GB, 0.65, intra="nvlink5", fp8_flops=4.5e15,
        sms=148),
    Gpu("MI250X", 383e12, 128 * GB, 3200 * GB, 0.55, intra="infinity-fabric-3",
        inter="slingshot-11", gpus_per_node=4),
    Gpu("MI300X", 1300e12, 192 * GB, 5300 * GB, 0.6, intra="infinity-fabric-4", inter="ndr-ib",
        fp8_flops=2615e12),
)}

# Parts the planner prices for published runs beside ``GPUS``: measured-power variants of a GPUS
# part (the same silicon under a lower power cap: it reports the same device name, so the
# trainer's MFU peak is the nominal one, as published MFUs are) and older generations the
# trainer's MFU table does not name (``loom.train.flops``; it reports MFU n/a there).
VARIANTS: dict[str, Gpu] = {g.name: dataclasses.replace(g, launch_overhead=HOST_LAUNCH) for g in (
    # H100 SXM with 96 GB HBM2e at a 500 W power limit, the part of TorchTitan's published runs
    # (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "Hardware": "96GB HBM2e
    # with 2.4 TB/sec peak memory bandwidth", "the default 500W power limit, although tuning it
    # up to 700W TDP can potentially provide further speedups"; 96 GiB as six 16 GiB stacks, as
    # the 80 GB part is 80 GiB). The clock it sustains in large BF16 GEMMs under 500 W is not
    # published: 0.8 of the nominal 989 TFLOP/s is an estimate, known only to within 0.67-0.90.
    # Dynamic power goes as f * V^2: with the voltage at its floor the clock scales with power
    # (500/700 = 0.71, 0.67 allowing for static power a cap does not cut), with the voltage
    # tracking the clock as power^(1/3) ((500/700)^(1/3) = 0.89). Practitioners report 10-15%
    # longer steps at a 600 W cap (factryze.ai scale-atlas, "Power Capping"), the middle of that
    # range. Not fitted to any published run.
    Gpu("H100-SXM-500W", 989e12, 96 * GiB, 2400 * GB, 0.7, fp8_flops=1979e12,
        power_fraction=0.8, power_fraction_range=(0.67, 0.9), sms=132),
    # V100 SXM2 32 GB (NVIDIA V100 datasheet: 125 TFLOP/s dense FP16 tensor, 32 GB HBM2 at
    # 900 GB/s, NVLink 2 300 GB/s bidirectional) in 8-GPU nodes with one 100 Gb/s EDR
    # InfiniBand NIC per GPU (``edr-ib``; a DGX-1's four per eight GPUs: ``--inter edr-ib-x2``).
    Gpu("V100-SXM2-32GB", 125e12, 32 * GiB, 900 * GB, 0.7, intra="nvlink2", inter="edr-ib"),
    # V100 SXM3 32 GB at 450 W in a DGX-2H: 16 GPUs on NVSwitch, 8 EDR HCAs per node. Shoeybi et
    # al. 2019 (Megatron-LM, arXiv 1909.08053 §5): "512 Tesla V100 SXM3 32GB GPUs ... 300 GB/sec
    # bandwidth between GPUs inside a server via NVSwitch and 100 GB/sec of interconnect
    # bandwidth between servers using 8 InfiniBand adapters per server"; its 39 TFLOP/s baseline
    # is "30% of the theoretical peak", i.e. a 130 TFLOP/s peak (derived: the SXM3 part runs
    # above the SXM2's 125). Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054, evaluation) ran on
    # DGX-2 nodes of the same network: "400 V100 GPUs (25 DGX-2 nodes) with 800 Gbps internode
    # communication bandwidth".
    Gpu("V100-SXM3-32GB", 130e12, 32 * GiB, 900 * GB, 0.7, intra="nvswitch2",
        inter="edr-ib-x2", gpus_per_node=16),
)}

LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink2", 150 * GB, 5e-6),  # V100 SXM2: 6 links x 25 GB/s per direction
    Link("nvswitch2", 150 * GB, 5e-6),  # DGX-2(H): the same 6 NVLink 2 links into NVSwitch
    Link("nvlink3", 300 * GB, 5e-6),
    Link("nvlink4", 450 * GB, 5e-6),
    Link("nvlink4-h800", 200 * GB, 5e-6),  # H800: 8 NVLink 4 links of 25 GB/s per direction
    Link("nvlink5", 900 * GB, 5e-6),
    Link("pcie5", 64 * GB, 5e-6),
    Link("infinity-fabric-3", 100 * GB, 6e-6),  # MI250X: per-GCD-pair links of 50-100 GB/s
    Link("infinity-fabric-4", 448 * GB, 6e-6),  # MI300X: 7 x 64 GB/s per direction
    Link("edr-ib", 12.5 * GB, 10e-6),  # 100 Gb/s per GPU
    Link("edr-ib-x2", 6.25 * GB, 10e-6),  # one 100 Gb/s EDR NIC per 2 GPUs (DGX-2(H), DGX-1)
    Link("hdr-ib", 25 * GB, 10e-6),  # 200 Gb/s per GPU
    Link("ndr-ib", 50 * GB, 10e-6),  # 400 Gb/s per GPU
    Link("roce-400", 50 * GB, 12e-6),
    Link("slingshot-11", 25 * GB, 10e-6),  # 200 Gb/s per NIC, one NIC per MI250X module
    # Between sites (``loom plan --sites``): one uplink per site, shared by all its GPUs;
    # latencies of a metro / regional round trip's one-way half
    Link("wan-100mbit", 0.0125 * GB, 20e-3),
    Link("wan-1gbit", 0.125 * GB, 20e-3),
    Link("wan-10gbit", 1.25 * GB, 10e-3),
    Link("wan-100gbit", 12.5 * GB, 5e-3),
)}


# The largest downlink : uplink ratio a cluster may declare: real fabrics are 1-7 (Llama 3's
# aggregation layer: 7); far beyond, a link's bandwidth divided by it underflows toward zero
# (1e308 made a link of bandwidth 0, which the link's own check then raised on)
MAX_OVERSUBSCRIPTION = 1000.0


@dataclass(frozen=True)
class Cluster:
    """N accelerators of one type, ``gpus_per_node`` of them per node.

    Topology (defaults: non-blocking, every node one hop from every other): nodes sit
    ``nodes_per_rack`` to a rack (0: one rack) behind a top-of-rack switch whose uplinks carry
    1 / ``rack_oversubscription`` of its downlinks' bandwidth, and racks ``racks_per_pod`` to a
    pod (0: one pod) behind a spine (aggregation) layer oversubscribed ``spine_oversubscription``
    to 1 towards the other pods (Llama 3's RoCE cluster: 7). A collective whose groups span
    racks shares the rack's uplinks among the streams that leave it (``link_for``): every group
    of the collective runs at once (all data-parallel groups reduce together), each sends out
    of a rack one stream per NIC its members use in a node (NCCL's rings and p2p: one channel
    per NIC), and the rack's uplinks carry rack GPUs x bandwidth / ratio. The inter-node
    bandwidth is divided by the resulting overload, never below 1; a group spanning pods is
    checked against the pod's uplinks too, oversubscribed by both ratios.
    """

    gpu: Gpu
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    # NICs of a node sharing its inter-node bandwidth (gpus_per_node x inter's); 0: one per GPU.
    # Modelled only: varlen pricing's routing layer (loom.sim.varlen_cost) reads it.
    nics_per_node: int = 0
    nodes_per_rack: int = 0  # nodes behind one top-of-rack switch; 0: all of them
    rack_oversubscription: float = 1.0  # a rack's downlink : uplink bandwidth (1: non-blocking)
    racks_per_pod: int = 0  # racks behind one spine layer; 0: all of them
    spine_oversubscription: float = 1.0  # a pod's downlink : uplink bandwidth (1: non-blocking)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("cluster: gpus and gpus_per_node must be >= 1")
        for name in ("nodes_per_rack", "racks_per_pod"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster: {name}={getattr(self, name)} must be >= 0 (0: all)")
        for name in ("rack_oversubscription", "spine_oversubscription"):
            if not 1 <= getattr(self, name) <= MAX_OVERSUBSCRIPTION:
                raise ValueError(f"cluster: {name}={getattr(self, name)} must be in [1,"
                                 f" {MAX_OVERSUBSCRIPTION:g}] (downlink : uplink; 1 is"
                                 " non-blocking)")
        if self.racks_per_pod and not self.nodes_per_rack:
            raise ValueError(f"cluster: racks_per_pod={self.racks_per_pod} needs nodes_per_rack"
                             " (the size of a rack)")
        if self.nics_per_node < 0:
            raise ValueError(f"cluster: nics_per_node={self.nics_per_node} must be >= 0")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"cluster: gpus={self.gpus} must be a multiple of gpus_per_node="
                             f"{self.gpus_per_node}")

    def link_for(self, group_size: int, stride: int) -> Link:
        """The link a group of ``group_size`` ranks ``stride`` apart in the rank order uses: the
        intra-node link when the whole group sits inside one node (ranks are packed node by node),
        else the inter-node link, which bounds a hierarchical or flat collective alike; its
        bandwidth divided by the overload of the rack's (and pod's) uplinks when the groups span
        racks (pods), the class docstring's topology (``uplink_overload``)."""
        span = group_size * stride
        if span <= self.gpus_per_node:
            return self.intra
        rack = self.gpus_per_node * self.nodes_per_rack
        if not rack or span <= rack:
            return self.inter
        ratio = self.uplink_overload(stride, rack, self.rack_oversubscription)
        pod = rack * self.racks_per_pod
        if pod and span > pod:
            ratio = max(ratio, self.uplink_overload(
                stride, pod, self.rack_oversubscription * self.spine_oversubscription))
        return _oversubscribed(self.inter, ratio)

    def uplink_overload(self, stride: int, domain: int, oversubscription: float) -> float:
        """How many times the uplinks of a domain of ``domain`` GPUs (a rack, a pod) are
        overloaded when every group of ranks ``stride`` apart that spans domains communicates at
        once, each GPU's NIC at full bandwidth B: a group has ``members = domain / stride`` ranks
        in a domain (1 when ``stride`` >= ``domain``) and leaves it on ``streams = gpus_per_node /
        stride`` NICs (its members in one node, at least 1); the domain holds ``domain /
        members`` such groups, so ``domain / members * streams * B`` leaves it through uplinks of
        ``domain * B / oversubscription``: overload ``oversubscription * streams / members``, at
        least 1. Every member's traffic leaves (``oversubscription`` itself) when each member
        sits in a domain of its own."""
        members = max(1, domain // stride)
        streams = max(1, self.gpus_per_node // stride)
        return max(1.0, oversubscription * streams / members)

    def describe(self) -> str:
        nodes = max(1, self.gpus // self.gpus_per_node)
        return (f"{self.gpus} x {self.gpu.name} ({nodes} node(s) of {self.gpus_per_node}; "
                f"{self.intra.name} {self.intra.bandwidth / GB:g} GB/s inside a node, "
                f"{self.inter.name} {self.inter.bandwidth / GB:g} GB/s between nodes"
                + (f"; {self.nodes_per_rack} nodes per rack, uplinks"
                   f" {self.rack_oversubscription:g}:1" if self.nodes_per_rack else "")
                + (f"; {self.racks_per_pod} racks per pod, spine"
                   f" {self.spine_oversubscription:g}:1" if self.racks_per_pod else "") + ")")


# The ``[cluster]`` keys of a hardware file that describe the network's topology.
TOPOLOGY_KEYS = ("nodes_per_rack", "rack_oversubscription", "racks_per_pod",
                 "spine_oversubscription")


@functools.lru_cache(maxsize=64)
def _oversubscribed(link: Link, ratio: float) -> Link:
    """``link`` with 1 / ``ratio`` of its bandwidth (cached: the planner asks for it often)."""
    if ratio == 1:
        return link
    return dataclasses.replace(link, name=f"{link.name}/{ratio:g}",
                               bandwidth=link.bandwidth / ratio)


class HardwareError(ValueError):
    """An unknown accelerator or link, or a malformed hardware file; names the entry."""


def _from_table(kind: type, name: str, table: dict[str, Any]) -> Any:
    fields = {f.name for f in dataclasses.fields(kind)} - {"name"}
    unknown = set(table) - fields - {"memory_gb", "hbm_gbps", "bandwidth_gbps", "latency_us"}
    if unknown:
        raise HardwareError(f"{kind.__name__.lower()}.{name}: unknown key(s) {sorted(unknown)};"
                            f" known: {sorted(fields)}")
    values = dict(table)
    try:
        for given, field, scale in (("memory_gb", "memory_bytes", GB),
                                    ("hbm_gbps", "hbm_bandwidth", GB),
                                    ("bandwidth_gbps", "bandwidth", GB),
                                    ("latency_us", "latency", 1e-6)):
            if given in values:
                value = values.pop(given)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{given} must be a number, got {value!r}")
                values[field] = float(value) * scale
        return kind(name=name, **values)
    except (TypeError, ValueError, OverflowError) as err:
        raise HardwareError(f"{kind.__name__.lower()}.{name}: {err}") from None


def load_catalog(path: str | Path | None = None) -> tuple[dict[str, Gpu], dict[str, Link], dict]:
    """The built-in catalog, extended or overridden by the TOML file at ``path``."""
    gpus, links, defaults = {**GPUS, **VARIANTS}, dict(LINKS), {}
    if path is None:
        return gpus, links, defaults
    try:
        table = loads_toml(read_input_text(path))
    except InputFileError as err:
        raise HardwareError(f"--hardware {path}: {err.rule}") from None
    except tomllib.TOMLDecodeError as err:
        raise HardwareError(f"--hardware {path}: not valid TOML: {err}") from None
    for section in ("gpu", "link", "cluster"):
        if not isinstance(table.get(section, {}), dict):
            raise HardwareError(f"--hardware {path}: [{section}] must be a table")
    for section, kind, known in (("gpu", Gpu, gpus), ("link", Link, links)):
        for name, entry in table.get(section, {}).items():
            if not isinstance(entry, dict):
                raise HardwareError(f"--hardware {path}: [{section}.{name}] must be a table")
            known[name] = _from_table(kind, name, entry)
    return gpus, links, table.get("cluster", {})


def make_cluster(gpu: str, gpus: int, gpus_per_node: int | None = None, *, intra: str | None = None,
                 inter: str | None = None, catalog: tuple[dict, dict, dict] | None = None,
                 nics_per_node: int = 0, network: dict[str, float] | None = None) -> Cluster:
    """Build a Cluster from catalog names; unknown names are refused with the known ones.
    ``network`` (keys of ``TOPOLOGY_KEYS``: ``loom plan --nodes-per-rack`` and the like, a
    published row's ``[run.topology]``) overrides the catalog's ``[cluster]`` topology."""
    gpu_table, link_table, defaults = catalog or ({**GPUS, **VARIANTS}, LINKS, {})
    # the link names and the node size may come from a catalog file's [cluster] table
    for role, name in (("intra", intra), ("inter", inter)):
        if name is not None and not isinstance(name, str):
            raise HardwareError(f"--{role} {name!r}: must be a link's name")
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool)
                                      or not isinstance(gpus_per_node, int) or gpus_per_node < 1):
        raise HardwareError(f"gpus_per_node {gpus_per_node!r} (--gpus-per-node, or the catalog's"
                            " [cluster] table): must be a whole number >= 1")
    topology = {}
    for key in TOPOLOGY_KEYS:
        given = key in (network or {})
        if given or key in defaults:
            value = (network or {})[key] if given else defaults[key]
            kind = int if key.endswith(("_rack", "_pod")) else float
            where = f"--{key.replace('_', '-')}" if given else f"cluster.{key}"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and not float(value).is_integer()):
                raise HardwareError(f"{where}: {value!r} must be a"
                                    f" {'whole ' if kind is int else ''}number")
            topology[key] = kind(value)
    key = next((k for k in gpu_table if k.lower() == gpu.lower()), None)
    if key is None:
        raise HardwareError(f"--gpu {gpu}: unknown accelerator; known: {', '.join(gpu_table)}")
    device = gpu_table[key]
    links = []
    for role, name in (("intra", intra or device.intra), ("inter", inter or device.inter)):
        if name not in link_table:
            raise HardwareError(f"--{role} {name}: unknown link; known: {', '.join(link_table)}")
        links.append(link_table[name])
    per_node = gpus_per_node or device.gpus_per_node
    try:
        return Cluster(device, gpus, min(per_node, gpus), *links, nics_per_node=nics_per_node,
                       **topology)
    except (TypeError, ValueError) as err:
        raise HardwareError(str(err)) from None


__all__ = ["Gpu", "Link", "Cluster", "GPUS", "VARIANTS", "LINKS", "GB", "GiB", "HardwareError",
           "TOPOLOGY_KEYS", "load_catalog", "make_cluster"]
