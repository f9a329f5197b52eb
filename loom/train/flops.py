"""The device peak that model FLOPs are divided by, for MFU.

MFU (model FLOPs utilization, Chowdhery et al. 2022 App. B) needs two numbers: how many FLOPs the
model *mathematically* requires per token (no recompute, no hardware tricks counted), and what the
device could do at best. The first is a closed formula over the architecture
(``loom.formulas.flops.training_flops_per_token``, shared with the planner); the second comes from a table of datasheet dense BF16 peaks
for known GPUs, or, where no honest table entry exists (CPU, unknown accelerators, non-16-bit
dtypes), from timing large square matmuls on the device itself (:func:`measure_matmul_peak`).
A measured peak makes CPU MFU meaningful ("fraction of what this box's BLAS can do") instead of
a fraction of some invented number.
"""

from __future__ import annotations

import math
import time

import torch

# Dense (non-sparse) 16-bit tensor-core peaks in FLOP/s, matched against
# torch.cuda.get_device_name() by substring, most specific first (an "H100 NVL" also contains
# "H100"). Values: REFERENCE.md §0, which takes them from torchtitan
# torchtitan/tools/utils.py::get_peak_flops (Narayanan et al. 2021 §5 for the A100).
_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835e12),
    ("H100 PCIE", 756e12),
    ("H100", 989e12),  # SXM; torchtitan's default for any other H100 name
    ("H200", 989e12),
    ("B200", 2.25e15),
    ("MI300X", 1300e12),
    ("MI250X", 383e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A6000", 154.85e12),
)
# The table is only valid for these dtypes: fp32 / tf32 peaks are different numbers entirely.
_TABLE_DTYPES = (torch.bfloat16, torch.float16)

_PEAK_CACHE: dict[tuple[str, int | None, torch.dtype, int], tuple[float, str]] = {}


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device``; a no-op on CPU (which runs eagerly).

    Timers must call this before reading the clock: accelerator kernels launch asynchronously,
    so without it a "step time" measures only the Python launch overhead.
    """
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps, ...
    sync = getattr(backend, "synchronize", None)
    if sync is None:
        return
    if device.type in ("cuda", "xpu"):
        sync(device)
    else:  # e.g. torch.mps.synchronize() takes no device
        sync()


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int | None = None, seconds: float = 0.3
) -> float:
    """Best observed FLOP/s of square ``size`` x ``size`` matmuls on ``device`` in ``dtype``.

    One matmul of n x n by n x n is 2·n³ FLOPs. After a warm-up (thread pools, BLAS kernels and
    caches get set up on first use), matmuls are run in short timed batches for about ``seconds``
    and the *best* batch rate is returned: the question is what the device can do, and the best
    rate is the estimate least disturbed by other load. Default size: 1024 on CPU (large enough
    for BLAS to reach its plateau, small enough to time quickly), 4096 on accelerators.
    """
    n = size if size is not None else (1024 if device.type == "cpu" else 4096)
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    flops_per_mm = 2.0 * n**3

    def timed(reps: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        synchronize(device)
        return time.perf_counter() - t0

    first = timed(1)  # warm-up, also a first guess of the cost of one matmul
    reps = max(1, int(0.05 / max(first, 1e-9)))  # batches of ~50 ms keep timer noise negligible
    best = flops_per_mm / max(first, 1e-9)
    deadline = time.perf_counter() + seconds
    while True:
        elapsed = timed(reps)
        best = max(best, flops_per_mm * reps / max(elapsed, 1e-9))
        if time.perf_counter() >= deadline:
            break
    if not math.isfinite(best) or best <= 0:
        raise RuntimeError(f"measure_matmul_peak: implausible rate {best} on {device} / {dtype}")
    return best


def _table_peak(device_name: str) -> float | None:
    upper = device_name.upper()
    for key, peak in _PEAK_BF16_FLOPS:
        if key in upper:
            return peak
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` in ``dtype`` and where the number comes from.

    Returns ``(peak, source)``. For a CUDA/ROCm device whose name is in the table and a 16-bit
    dtype, ``source`` is ``"table:<device name>"`` (dense BF16 datasheet peak, REFERENCE.md §0 /
    torchtitan ``get_peak_flops``). Everything else (CPU, unknown GPUs, fp32) is measured with
    :func:`measure_matmul_peak` and ``source`` is ``"measured"``. Results are cached per
    (device type, device index, dtype, torch threads), because a measurement costs ~0.3 s and
    the CPU rate depends on the thread count.
    """
    device = torch.device(device)
    key = (device.type, device.index, dtype, torch.get_num_threads())
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    result: tuple[float, str] | None = None
    if device.type == "cuda" and dtype in _TABLE_DTYPES and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        peak = _table_peak(name)
        if peak is not None:
            result = (peak, f"table:{name}")
    if result is None:
        result = (measure_matmul_peak(device, dtype), "measured")
    _PEAK_CACHE[key] = result
    return result
