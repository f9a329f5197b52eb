"""The gradient compressors' pieces on single tensors (``loom.parallel.compression``): int8
quantization and top-k selection keep ``sent + residual == input``, PowerSGD's power step is exact
at full rank, L-GreCo measures PowerSGD's own error per rank, and L-GreCo's dynamic program finds the brute-force optimum within the budget. The
same compressors across two ranks (collectives, error feedback over steps, the ledger) are
``tests/dist/test_grad_compression.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from loom.config import ConfigError, load_config, resolve
from loom.layout import CompressionSpec
from loom.parallel.compression import (INT8_CHUNK, Int8Compressor, PowerSGDCompressor,
                                       TopKCompressor, choose_levels, orthonormalize)


def _tensor(numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # magnitudes over several decades, like gradients, and a few exact zeros
    values = torch.randn(numel, generator=generator) * torch.logspace(-4, 0, numel)
    values[::97] = 0.0
    return values


@pytest.mark.parametrize("numel", [1, 1000, INT8_CHUNK, 3 * INT8_CHUNK + 5])
def test_int8_sent_plus_residual_is_the_input(numel):
    flat = _tensor(numel, numel)
    q, scales, sent = Int8Compressor.quantize(flat)
    assert q.dtype == torch.int8 and q.numel() == numel
    assert scales.numel() == math.ceil(numel / INT8_CHUNK)
    assert q.numel() + 4 * scales.numel() == Int8Compressor.payload_bytes(numel)
    residual = flat - sent
    # the identity error feedback relies on, within fp32 rounding of one subtraction
    torch.testing.assert_close(sent + residual, flat, rtol=0, atol=1e-7)
    # the decoded values are what a peer computes from the int8 payload and the scales
    padded = torch.zeros(scales.numel() * INT8_CHUNK)
    padded[:numel] = q.float()
    decoded = (padded.view(-1, INT8_CHUNK) * scales[:, None]).view(-1)[:numel]
    assert torch.equal(decoded, sent)
    # rounding to the nearest of 255 levels: at most half a step per chunk
    for chunk, scale in zip(residual.split(INT8_CHUNK), scales):
        assert chunk.abs().max() <= scale / 2 * (1 + 1e-6)


def test_int8_all_zero_chunk_sends_zeros():
    q, scales, sent = Int8Compressor.quantize(torch.zeros(10))
    assert not q.any() and not scales.any() and not sent.any()


def test_int8_error_feedback_over_steps_sums_to_the_true_sum():
    """Over steps: everything sent plus the last residual is the sum of every input."""
    residual, sent_total, true_total = torch.zeros(3000), torch.zeros(3000), torch.zeros(3000)
    for step in range(5):
        grad = _tensor(3000, 100 + step)
        accumulated = grad + residual
        _, _, sent = Int8Compressor.quantize(accumulated)
        residual = accumulated - sent
        sent_total += sent
        true_total += grad
    torch.testing.assert_close(sent_total + residual, true_total, rtol=0, atol=1e-6)
    assert residual.abs().max() > 0  # something was actually held back


@pytest.mark.parametrize("k", [1, 17, 500])
def test_topk_selects_the_largest_magnitudes(k):
    tensor = _tensor(500, k).view(20, 25)
    indices, values = TopKCompressor.select(tensor, k)
    assert indices.numel() == k == len(set(indices.tolist()))
    assert torch.equal(values, tensor.reshape(-1)[indices])
    rest = torch.ones(500, dtype=torch.bool)
    rest[indices] = False
    if k < 500:
        assert values.abs().min() >= tensor.reshape(-1)[rest].abs().max()
    # sent (scattered back) + residual (the rest) is the tensor, exactly
    sent = torch.zeros(500).index_add_(0, indices, values)
    residual = tensor.reshape(-1).clone()
    residual[indices] = 0
    assert torch.equal(sent + residual, tensor.reshape(-1))


@pytest.mark.parametrize("rows, cols", [(12, 7), (7, 12), (16, 16)])
def test_powersgd_power_step_is_exact_at_full_rank(rows, cols):
    """P = M Q, orthonormalized; Q = M^T P: P Q^T is M when the rank is min(rows, cols)."""
    matrix = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols),
                         dtype=torch.float64)
    rank = min(rows, cols)
    q = torch.randn(cols, rank, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    basis = orthonormalize(matrix @ q)
    torch.testing.assert_close(basis.t() @ basis, torch.eye(rank, dtype=torch.float64))
    torch.testing.assert_close(basis @ (matrix.t() @ basis).t(), matrix)


def test_powersgd_power_step_below_full_rank_is_a_projection():
    """At rank 1 the approximation is the projection of M onto one direction: smaller error
    than sending nothing, never exact for a full-rank matrix."""
    matrix = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    basis = orthonormalize(matrix @ torch.randn(8, 1, generator=torch.Generator().manual_seed(4)))
    approximation = basis @ (matrix.t() @ basis).t()
    error = (matrix - approximation).norm()
    assert 0 < error < matrix.norm()


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (6, 5, 8)])
def test_lgreco_measures_powersgd_error_of_one_warm_started_power_step(shape):
    """L-GreCo's table for a PowerSGD tensor is the squared error the compressor itself would
    leave at each level's rank (P = M Q_r orthonormalized, approximation P P^T M), computed
    separately per rank here; it falls as the rank grows and is zero where the level sends the
    tensor whole."""
    param = nn.Parameter(torch.zeros(shape))
    spec = CompressionSpec(method="powersgd", rank=4, adaptive="lgreco", refresh=1,
                           min_compression_rate=1.0)
    compressor = PowerSGDCompressor([param], group=None, size=1, spec=spec, seed=3)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    measured = compressor._level_errors(0, grad)
    matrix = grad.double().reshape(shape[0], -1)
    for level, value in enumerate(measured):
        rank = compressor.rank_of(0, level)
        if rank is None:
            assert value == 0
            continue
        basis = orthonormalize(matrix @ compressor.q[0][:, :rank].double())
        expected = (matrix - basis @ (basis.t() @ matrix)).square().sum()
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-9)
    assert (measured[1:] <= measured[:-1] + 1e-9).all()
    lossy = [value for level, value in enumerate(measured) if compressor.rank_of(0, level)]
    assert lossy[0] > lossy[-1] > 0  # below full rank a random matrix is never exact


def _brute_force(errors: torch.Tensor, sizes: torch.Tensor, budget: float) -> float:
    best = math.inf
    for choice in itertools.product(range(errors.shape[1]), repeat=errors.shape[0]):
        error = sum(float(errors[layer, level]) for layer, level in enumerate(choice))
        if error <= budget:
            best = min(best, sum(float(sizes[layer, level]) for layer, level in enumerate(choice)))
    return best


def _tables(seed: int, layers: int = 4, levels: int = 4, integer: bool = False):
    """Levels ordered like compression levels: error falls as size grows."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.rand(layers, levels, generator=generator).mul(100).add(1).sort(dim=1).values
    errors = torch.rand(layers, levels, generator=generator).mul(50).sort(dim=1,
                                                                         descending=True).values
    if integer:
        sizes, errors = sizes.round(), errors.round()
    return errors.double(), sizes.double()


@pytest.mark.parametrize("seed", range(8))
def test_lgreco_dynamic_program_equals_brute_force_on_integer_errors(seed):
    """Integer errors with a budget of as many bins as error units: the discretization is exact,
    so the program's choice is the brute-force optimum."""
    errors, sizes = _tables(seed, integer=True)
    reference = 1
    budget = float(errors[:, reference].sum())
    picked = choose_levels(errors, sizes, reference, bins=int(budget))
    total_error = sum(float(errors[layer, level]) for layer, level in enumerate(picked))
    total_size = sum(float(sizes[layer, level]) for layer, level in enumerate(picked))
    assert total_error <= budget
    assert total_size == _brute_force(errors, sizes, budget)


@pytest.mark.parametrize("seed", range(8))
def test_lgreco_dynamic_program_on_real_errors(seed):
    """Real-valued errors: the choice is within the budget, no larger than the uniform level,
    and within a discretization step of the brute-force optimum."""
    errors, sizes = _tables(100 + seed, layers=5, levels=5)
    reference = 2
    budget = float(errors[:, reference].sum())
    picked = choose_levels(errors, sizes, reference)
    total_error = sum(float(errors[layer, level]) for layer, level in enumerate(picked))
    total_size = sum(float(sizes[layer, level]) for layer, level in enumerate(picked))
    assert total_error <= budget + 1e-9
    assert total_size <= float(sizes[:, reference].sum())
    optimum = _brute_force(errors, sizes, budget)
    # rounding each layer's error up by < budget / 1000 costs at most a budget of 5 / 1000
    assert total_size <= _brute_force(errors, sizes, budget * (1 - 5 / 1000)) + 1e-9
    assert total_size >= optimum - 1e-9


def test_lgreco_keeps_the_uniform_level_when_nothing_beats_it():
    errors = torch.tensor([[4.0, 2.0, 0.0], [4.0, 2.0, 0.0]], dtype=torch.float64)
    sizes = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    # trading one layer up and one down keeps error and size equal: the uniform choice stays
    assert choose_levels(errors, sizes, 1) == [1, 1]
    # a zero budget admits exact levels only
    assert choose_levels(errors, sizes, 2) == [2, 2]


def _config(**overrides):
    return resolve(load_config(None, {"model.preset": "debug", **overrides}), 2)


@pytest.mark.parametrize("overrides, field, words", [
    ({"parallel.compression_adaptive": "lgreco"}, "parallel.compression_adaptive",
     "base compressor"),
    ({"parallel.compression_adaptive": "lgreco", "parallel.grad_compression": "int8"},
     "parallel.compression_adaptive", "not int8"),
    ({"parallel.grad_compression": "int8", "parallel.dp_shard": "2", "parallel.dp_replicate": "1"},
     "parallel.grad_compression", "ZeRO"),
    ({"parallel.grad_compression": "topk", "parallel.dp_shard": "2", "parallel.dp_replicate": "1",
      "parallel.zero_stage": "1"}, "parallel.grad_compression", "ZeRO"),
    ({"parallel.grad_compression": "powersgd", "parallel.dp_mode": "diloco"},
     "parallel.grad_compression", "dp_mode = diloco"),
    ({"parallel.grad_compression": "int8", "train.grad_reduce_dtype": "bf16"},
     "train.grad_reduce_dtype", "own format"),
    ({"parallel.compression_rank": "0"}, "parallel.compression_rank", ">= 1"),
    ({"parallel.compression_topk_ratio": "0"}, "parallel.compression_topk_ratio", "(0, 1]"),
    ({"parallel.compression_topk_ratio": "1.5"}, "parallel.compression_topk_ratio", "(0, 1]"),
    ({"parallel.compression_refresh": "0"}, "parallel.compression_refresh", ">= 1"),
    ({"parallel.grad_compression": "zip"}, "parallel.grad_compression", "must be one of"),
])
def test_config_refuses(overrides, field, words):
    with pytest.raises(ConfigError) as err:
        _config(**overrides)
    assert err.value.field_name == field and words in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides", [
    {"parallel.grad_compression": "int8"},
    {"parallel.grad_compression": "powersgd", "parallel.compression_adaptive": "lgreco"},
    {"parallel.grad_compression": "topk", "parallel.compression_adaptive": "lgreco",
     "parallel.compression_refresh": "10"},
    # expert shards get a compressor of their own (tests/dist/test_grad_compression.py)
    {"parallel.grad_compression": "int8", "model.preset": "tiny-moe", "parallel.ep": "2",
     "parallel.dp_replicate": "1"},
])
def test_config_accepts(overrides):
    _config(**overrides)
