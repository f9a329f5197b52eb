"""``generate_tokens`` refuses the sampling arguments ``loom generate`` refuses: the limits live
in the library (``loom.generate.sampling_errors``), not only in the command."""

import math

import pytest
import torch

from loom.generate import MAX_NEW_TOKENS, TEMPERATURE_BAND, generate_tokens, sampling_errors


class _Uniform(torch.nn.Module):
    """Equal logits over 8 tokens: any sample is valid, so only the argument checks matter."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, ids.shape[1], 8)


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1e-300}, "temperature"),  # float32 logits / t overflow to inf
    ({"temperature": 1e300}, "temperature"),  # the padding rows' -inf / inf is NaN
    ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
])
def test_a_broken_sampling_argument_is_refused_by_name(kwargs: dict, name: str) -> None:
    args = {"max_new_tokens": 2, "temperature": 0.8, "top_k": 5} | kwargs
    with pytest.raises(ValueError, match=f"^{name} = "):
        generate_tokens(_Uniform(), torch.zeros(1, 1, dtype=torch.long), **args)


def test_valid_arguments_sample_and_break_no_rule() -> None:
    assert sampling_errors(MAX_NEW_TOKENS, 0.0, 0) == []
    new = generate_tokens(_Uniform(), torch.zeros(1, 1, dtype=torch.long), max_new_tokens=3,
                          temperature=1.0, top_k=0, generator=torch.Generator().manual_seed(0))
    assert len(new) == 3 and all(0 <= t < 8 for t in new)


@pytest.mark.parametrize("temperature", TEMPERATURE_BAND)
def test_the_temperature_band_edges_sample_real_tokens_past_padding_rows(temperature: float) -> None:
    """At both edges of the band the softmax stays finite, padding rows included (8 logits, a
    vocabulary of 6): every sampled token is a real one."""
    model = _Uniform()
    new = generate_tokens(model, torch.zeros(1, 1, dtype=torch.long), max_new_tokens=20,
                          temperature=temperature, top_k=0, vocab_size=6,
                          generator=torch.Generator().manual_seed(0))
    assert len(new) == 20 and all(0 <= t < 6 for t in new)
