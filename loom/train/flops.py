"""The device peak that model FLOPs are divided by, for MFU, and where that number comes from.

MFU (model FLOPs utilization, Chowdhery et al. 2022 App. B) needs two numbers: how many FLOPs the
model *mathematically* requires per token (no recompute, no hardware tricks counted), and what the
device could do at best. The first is a closed formula over the architecture
(``loom.formulas.flops.training_flops_per_token``, shared with the planner). The second is a
*stated* peak, never a guess: ``metrics.peak_tflops`` when set, else, on a GPU computing in 16 bits
(``train.dtype = bf16``), the dense BF16 datasheet peak of the catalog accelerator that the
device's name matches. Anything else (a CPU, an unknown accelerator, fp32 compute, whose peak is a
different number) has no stated peak, and MFU is reported as n/a. A peak timed on the spot
(large matmuls, what this module did before) makes MFU a fraction of what the box happened to do
at that moment, which on a loaded machine can come out above 100%.

The name table is the device-name lookup of the planner's catalog (``loom.plan.hardware.GPUS``,
same numbers, plus two cards the planner does not model): the trainer sits a floor below the
planner (tests/unit/test_layering.py), so it keeps its own copy, and a test checks that the two
agree.
"""

from __future__ import annotations

import torch

# Dense (non-sparse) 16-bit tensor-core peaks in FLOP/s, matched against
# torch.cuda.get_device_name() by substring, most specific first (an "H100 NVL" also contains
# "H100"): (substring, catalog name, peak). Values: REFERENCE.md §0, which takes them from
# torchtitan torchtitan/tools/utils.py::get_peak_flops (Narayanan et al. 2021 §5 for the A100).
_PEAK_BF16_FLOPS: tuple[tuple[str, str, float], ...] = (
    ("H100 NVL", "H100-NVL", 835e12),
    ("H100 PCIE", "H100-PCIe", 756e12),
    ("H100", "H100-SXM", 989e12),  # SXM; torchtitan's default for any other H100 name
    ("H200", "H200", 989e12),
    ("H800 PCIE", "H800-PCIe", 756e12),  # the H100 PCIe's peak; the planner does not model it
    ("H800", "H800", 989e12),  # SXM
    ("B200", "B200", 2.25e15),
    ("MI300X", "MI300X", 1300e12),
    ("MI250X", "MI250X", 383e12),
    ("A100", "A100", 312e12),
    ("L40S", "L40S", 362e12),
    ("A6000", "A6000", 154.85e12),
)
# The table is only valid for these dtypes: fp32 / tf32 peaks are different numbers entirely.
_TABLE_DTYPES = (torch.bfloat16, torch.float16)


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


def catalog_peak(device_name: str) -> tuple[str, float] | None:
    """(catalog name, dense BF16 peak FLOP/s) of the accelerator ``device_name`` (what
    ``torch.cuda.get_device_name`` says) matches, or None for an unknown one."""
    upper = device_name.upper()
    for key, name, peak in _PEAK_BF16_FLOPS:
        if key in upper:
            return name, peak
    return None


def device_peak_flops(device: torch.device | str, dtype: torch.dtype,
                      stated_tflops: float = 0.0) -> tuple[float | None, str]:
    """The peak FLOP/s of one ``device`` computing in ``dtype`` that MFU is reported against,
    and where it comes from: ``(peak, source)``, or ``(None, why there is none)``.

    ``stated_tflops`` (``metrics.peak_tflops``) > 0 wins; else a CUDA/ROCm device whose name
    matches the catalog, computing in a 16-bit dtype, gets the catalog's peak. A CPU, an
    unknown accelerator or fp32 compute get None: MFU n/a, not a fraction of an invented peak.
    """
    device = torch.device(device)
    if stated_tflops > 0:
        return stated_tflops * 1e12, "metrics.peak_tflops"
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, f"no stated peak for a {device.type} device; set --metrics.peak_tflops"
    name = torch.cuda.get_device_name(device)
    found = catalog_peak(name)
    if found is None:
        return None, f"{name!r} is not in the catalog; set --metrics.peak_tflops"
    if dtype not in _TABLE_DTYPES:
        return None, (f"the catalog's peak of {name} is dense BF16, the run computes in"
                      f" {str(dtype).removeprefix('torch.')}; set --metrics.peak_tflops")
    return found[1], f"catalog {found[0]}: {name}"


def describe_peak(peak: float | None, source: str) -> str:
    """One line for the start of the log: the peak MFU is reported against, or why MFU is n/a."""
    if peak is None:
        return f"MFU n/a ({source})"
    return f"MFU against {peak / 1e12:,.4g} TFLOP/s per device ({source})"
