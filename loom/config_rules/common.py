"""Helpers every rule module uses: positive and divisible fields, refused with the nearest
valid values."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.errors import ConfigError

if TYPE_CHECKING:  # the rules read a config; loom.config imports them to run them in resolve()
    from loom.config import Config


def nearest_multiples(value: int, divisor: int) -> str:
    low = (value // divisor) * divisor
    options = [v for v in (low, low + divisor) if v > 0]
    return " or ".join(str(v) for v in options)


def require_divisible(field_name: str, value: int, divisor: int, what: str) -> None:
    if divisor > 1 and value % divisor:
        raise ConfigError(field_name, value, f"must be divisible by {what} = {divisor};"
                          f" nearest valid: {nearest_multiples(value, divisor)}")


def require_positive(config: Config, keys: list[str] | dict[str, str], minimum: float = 1) -> None:
    """Each field of ``keys`` must be >= ``minimum``; a dict also says, for the refusal, what
    each field's value means (``{"model.n_experts": "0: a dense model"}``)."""
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value < minimum:
            note = f" ({keys[key]})" if isinstance(keys, dict) else ""
            raise ConfigError(key, value, f"must be >= {minimum}{note}")


__all__ = ["nearest_multiples", "require_divisible", "require_positive"]
