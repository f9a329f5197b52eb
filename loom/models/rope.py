"""Rotary position embeddings (RoPE): the frequencies, their cos/sin tables, and the rotation.

Three frequency schedules, named as Hugging Face's ``rope_type`` names them:

* ``none`` (HF ``default``): ``f_i = theta ** (-2i / Hd)``, the RoFormer / Llama 2 schedule;
* ``linear``: every frequency divided by ``factor`` (position interpolation, Chen et al. 2023);
* ``llama3``: Meta's Llama 3.1 long-context adjustment. With ``L`` the original training
  context, a frequency whose wavelength ``2 pi / f`` is shorter than ``L / high_freq_factor`` is
  kept, one longer than ``L / low_freq_factor`` is divided by ``factor``, and those in between
  are interpolated with ``s = (L / wavelength - low_freq_factor) / (high_freq_factor -
  low_freq_factor)``: ``f' = (1 - s) f / factor + s f``.

Why hand-written: these are a few lines of arithmetic, and the model (floor 0) must not import
``transformers``. Tables are computed in fp64 and stored in fp32, so they do not depend on the
device or on the accumulated rounding of fp32 angle products at long positions.
"""

from __future__ import annotations

import math

import torch

from loom.models.args import ROPE_SCALINGS, RopeScaling

def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None = None) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies (radians per position), fp64."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = scaling or RopeScaling()
    if scaling.kind == "none":
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(freq, scaling)
    raise ValueError(f"unknown RoPE scaling {scaling.kind!r}; known: {', '.join(ROPE_SCALINGS)}")


def _llama3(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rescaling (module docstring): keep the high frequencies, divide the low ones
    by ``factor``, blend linearly in between."""
    wavelength = 2 * math.pi / freq
    short = s.original_max_len / s.high_freq_factor  # wavelengths below: kept
    long = s.original_max_len / s.low_freq_factor  # wavelengths above: divided by factor
    blend = (s.original_max_len / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    between = (1 - blend) * freq / s.factor + blend * freq
    out = torch.where(wavelength > long, freq / s.factor, between)
    return torch.where(wavelength < short, freq, out)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, ``[max_seq_len, head_dim // 2]``, computed in fp64 then fp32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64),
                         inverse_frequencies(head_dim, theta, scaling))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_BSNH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... as Llama does (complex multiplication).

    The tables are ``[S, Hd/2]`` (one position per column, shared by the rows) or ``[B, S,
    Hd/2]`` (each row its own positions: packed documents restart at 0)."""
    x = x_BSNH.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x[..., 0], x[..., 1]
    if cos_SH.dim() == 3:
        cos, sin = cos_SH[:, :, None, :], sin_SH[:, :, None, :]
    else:
        cos, sin = cos_SH[None, :, None, :], sin_SH[None, :, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x_BSNH)
