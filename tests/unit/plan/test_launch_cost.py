"""Host-side kernel launches (``loom.sim.launch_cost``, ``Gpu.launch_overhead``): the kernel
counts are the dispatcher's own count of Loom's block, and a layer pass takes the longer of its
device time and its launches' host time."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.models.llama import TransformerBlock
from loom.models.presets import PRESETS
from loom.models.rope import rope_tables
from loom.plan.hardware import GB, GPUS, HOST_LAUNCH, Cluster, Gpu, Link, make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM
from loom.sim.launch_cost import block_kernels, host_bound

EAGER, COMPILED = LOOM.compiled_as(False), LOOM.compiled_as(True)


class _Kernels(TorchDispatchMode):
    """Counts the ops dispatched that launch a kernel: they return a tensor and are not views
    (``_unsafe_view`` is a reshape that aliases without being marked a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns_tensor = any("Tensor" in str(r.type) for r in func._schema.returns)
        if returns_tensor and not func.is_view and func.overloadpacket.__name__ != "_unsafe_view":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _dispatched(args: TransformerArgs, dtype: torch.dtype) -> tuple[int, int]:
    """(forward, backward) kernels of one pass of Loom's block, counted by the dispatcher."""
    torch.manual_seed(0)
    block = TransformerBlock(args).to(dtype)
    x = torch.randn(2, 16, args.dim, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(args.head_dim, 16, args.rope_theta)
    grad = torch.ones(2, 16, args.dim, dtype=dtype)
    with _Kernels() as forward:
        y = block(x, cos, sin)
    with _Kernels() as backward:
        y.backward(grad)
    return forward.count, backward.count


SMALL = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=8,
             max_seq_len=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    {}, {"mlp": "gelu"},
    {"n_experts": 4, "top_k": 2}, {"n_experts": 8, "top_k": 2},
    {"n_experts": 8, "top_k": 1, "n_shared_experts": 1},
    {"n_experts": 4, "top_k": 2, "n_shared_experts": 2},
])
def test_eager_kernel_count_is_the_dispatchers_count_of_loom_block(dtype, shape):
    args = TransformerArgs(**SMALL, **shape)
    e = 4 if dtype == torch.float32 else 2
    f, i, w = block_kernels(args, args.n_experts > 0, compiled=False, e=e)
    assert (f, i + w) == _dispatched(args, dtype)


def test_pinned_dense_counts():
    # the module docstring's counts of Llama's dense block (bf16: the casts around norms, RoPE)
    llama = PRESETS["llama3-8b"]
    assert block_kernels(llama, False, compiled=False, e=4) == (40, 55, 9)
    assert block_kernels(llama, False, compiled=False, e=2) == (48, 67, 9)
    assert block_kernels(llama, False, compiled=True, e=2) == (13, 12, 7)


@pytest.mark.parametrize("shape", [{}, {"mlp": "gelu"}, {"n_experts": 8, "top_k": 2},
                                   {"n_experts": 8, "top_k": 2, "n_shared_experts": 1}])
@pytest.mark.parametrize("e", [2, 4])
def test_compiled_blocks_launch_fewer_kernels(shape, e):
    args = TransformerArgs(**SMALL, **shape)
    moe = args.n_experts > 0
    eager = block_kernels(args, moe, compiled=False, e=e)
    compiled = block_kernels(args, moe, compiled=True, e=e)
    assert all(c < k for c, k in zip(compiled, eager))


def test_expert_parallelism_launches_only_the_local_experts():
    args = TransformerArgs(**SMALL, n_experts=8, top_k=2)
    whole, split = block_kernels(args, True, False, 2), block_kernels(args, True, False, 2, ep=4)
    assert tuple(a - b for a, b in zip(whole, split)) == (5 * 6, 13 * 6, 3 * 6)


def test_host_bound_is_the_longer_of_device_and_host():
    assert host_bound(1e-3, 10, 1e-5) == 1e-3  # device-bound: the host's 0.1 ms is hidden
    assert host_bound(1e-5, 10, 1e-5) == pytest.approx(1e-4)  # host-bound
    assert host_bound(1e-5, 10, 0.0) == 1e-5  # nothing priced


UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * GB, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
FAST = Link("fast", bandwidth=1e11, latency=0.0, efficiency=1.0)
MODEL = PRESETS["llama3-8b"]


def _passes(gpu: Gpu, seq: int, stack=EAGER) -> tuple[float, float, float]:
    f, i, w, _ = CostModel(MODEL, seq, 1, Cluster(gpu, 1, 1, FAST, FAST),
                           framework=stack)._layer_times(Layout(), False)
    return f, i, w


def test_a_short_pass_costs_its_launches_host_time():
    # a 16-token pass on a 10 us-per-kernel host: each pass is its kernels times 10 us
    slow_host = replace(UNIT, peak_flops=1e18, hbm_bandwidth=1e18, launch_overhead=1e-5)
    kernels = block_kernels(MODEL, False, compiled=False, e=2)
    assert _passes(slow_host, 16) == pytest.approx(tuple(k * 1e-5 for k in kernels))
    compiled = block_kernels(MODEL, False, compiled=True, e=2)
    assert _passes(slow_host, 16, COMPILED) == pytest.approx(tuple(k * 1e-5 for k in compiled))


def test_a_long_pass_is_unchanged():
    # 8192 tokens of Llama 3 8B's block on an H100: matmuls of milliseconds hide the launches
    h100 = make_cluster("H100-SXM", 1).gpu
    assert h100.launch_overhead == HOST_LAUNCH > 0
    for stack in (EAGER, COMPILED):
        with_host = _passes(h100, 8192, stack)
        assert with_host == _passes(replace(h100, launch_overhead=0.0), 8192, stack)
        kernels = block_kernels(MODEL, False, compiled=stack.compiled, e=2)
        assert all(t > 4 * k * HOST_LAUNCH for t, k in zip(with_host, kernels))


def test_catalog_accelerators_price_launches_and_a_plain_gpu_does_not():
    assert all(gpu.launch_overhead == HOST_LAUNCH for gpu in GPUS.values())
    assert UNIT.launch_overhead == 0.0  # a CPU profile's host is its device: op_overhead
