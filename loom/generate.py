"""Sampling text from a trained run, so a user can see what the model learned.

Reads ``config.toml``, the tokenizer and ``model.safetensors`` from the run directory (tensors
only, no pickle), then samples autoregressively with temperature and top-k on one device. The
model has no key/value cache, so each new token re-runs the visible window; fine for the small
models trained locally, and it keeps the model file free of inference-only code.
``generate_tokens`` is the loop on token ids alone (greedy at temperature 0), for any model
(an imported Hugging Face one included) without a tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom.config import load_config
from loom.config_rules import validate_model_shape
from loom.data.tokenizer import load_tokenizer
from loom.models import build_model, reset_parameters
from loom.config import model_args

# The most tokens ``loom generate`` samples in one call: there is no key/value cache, so each
# token re-runs the window (a bound on a command's time, not on the model)
MAX_NEW_TOKENS = 100_000
# Sampling divides float32 logits by the temperature: below 1e-4 the quotient overflows to inf and
# above 1e4 the padding rows' -inf become NaN; both make ``softmax`` NaN. Outside the band the
# sample is greedy or uniform to float32 precision anyway, so the band loses nothing.
TEMPERATURE_BAND = (1e-4, 1e4)


def sampling_errors(max_new_tokens: int, temperature: float, top_k: int) -> list[tuple[str, object, str]]:
    """The sampling arguments that break a rule, as ``(argument, value, rule)``: the one place
    the limits live, so ``generate_tokens`` refuses what ``loom generate`` refuses (a NaN
    temperature would otherwise sample from a softmax of NaNs)."""
    low, high = TEMPERATURE_BAND
    rules = (("max_new_tokens", max_new_tokens, 0 <= max_new_tokens <= MAX_NEW_TOKENS,
              f"must be in [0, {MAX_NEW_TOKENS:,}] (no key/value cache: each token re-runs"
              " the window)"),
             ("temperature", temperature, temperature == 0 or low <= temperature <= high,
              f"must be 0 (greedy) or in [{low:g}, {high:g}]"),  # NaN fails both
             ("top_k", top_k, top_k >= 0, "must be >= 0 (0: no cut)"))
    return [(name, value, rule) for name, value, ok, rule in rules if not ok]


def load_trained_model(run_dir: Path, device: torch.device):
    """The run's model with its final weights, in eval mode, and its tokenizer."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    weights = run_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found: has the run in {run_dir} finished?")
    config = load_config(run_dir / "config.toml", pretrained=False)
    validate_model_shape(config)
    args = model_args(config)
    model = build_model(args, device="meta")
    # The file's header against the model's shapes before any memory is taken: a config.toml
    # edited to another size is refused, not allocated.
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    with safe_open(str(weights), framework="pt") as handle:
        stored = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    allowed_missing = {"output.weight"} if args.tie_embeddings else set()
    missing = sorted(set(expected) - set(stored) - allowed_missing)
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the run's model: missing {missing},"
                         f" unexpected {unexpected}")
    for name in sorted(set(stored) & set(expected)):
        if stored[name] != expected[name]:
            raise ValueError(f"{weights}: {name} has shape {stored[name]}, the run's config.toml"
                             f" says {expected[name]}")
    model.to_empty(device=device)
    reset_parameters(model, seed=0)  # rebuilds the RoPE tables; every weight is then loaded
    model.load_state_dict(load_file(str(weights), device=str(device)), strict=False)
    return model.eval(), load_tokenizer(run_dir / "data"), config


@torch.no_grad()
def generate_tokens(model: torch.nn.Module, ids_1S: torch.Tensor, *, max_new_tokens: int,
                    temperature: float = 0.8, top_k: int = 50, window: int | None = None,
                    eos_id: int | None = None, vocab_size: int | None = None,
                    generator: torch.Generator | None = None) -> list[int]:
    """Up to ``max_new_tokens`` token ids sampled after the prompt ``ids_1S`` (``[1, S]``).

    Each step runs ``model`` on the last ``window`` tokens (default: all; no key/value cache)
    and picks the next token from the last position's logits: the argmax when ``temperature ==
    0`` (greedy; the first maximum on ties, as ``torch.argmax`` and HF's greedy search), else a
    sample of ``softmax(logits / temperature)`` over the ``top_k`` largest. Logit rows from
    ``vocab_size`` on (the embedding's padding) are never picked; ``eos_id`` stops, unreturned.
    Arguments outside ``sampling_errors``' rules raise ``ValueError`` naming the first.
    """
    for name, value, rule in sampling_errors(max_new_tokens, temperature, top_k)[:1]:
        raise ValueError(f"{name} = {value}: {rule}")
    ids = ids_1S
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = ids if window is None else ids[:, -window:]
        logits = model(context)[0, -1].float()
        if vocab_size is not None:
            logits[vocab_size:] = -float("inf")  # padding rows of the embedding
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                cutoff = logits.topk(top_k).values[-1]
                logits[logits < cutoff] = -float("inf")
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if token == eos_id:
            break
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return new


@torch.no_grad()
def generate(run_dir: Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0, device: str = "cpu") -> str:
    """The prompt followed by ``max_new_tokens`` sampled tokens (stops at end-of-document)."""
    dev = torch.device(device)
    model, tokenizer, config = load_trained_model(run_dir, dev)
    window = min(config.data.seq_len, config.model.max_seq_len)
    ids = torch.as_tensor(tokenizer.encode(prompt), dtype=torch.long, device=dev)[None]
    if ids.numel() == 0:
        ids = torch.tensor([[tokenizer.eos_id]], device=dev)
    generator = torch.Generator(device=dev).manual_seed(seed)
    new = generate_tokens(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_k=top_k, window=window, eos_id=tokenizer.eos_id,
                          vocab_size=tokenizer.vocab_size, generator=generator)
    return prompt + tokenizer.decode(new)
