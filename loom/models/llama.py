"""A Llama-style decoder-only transformer in plain PyTorch.

RMSNorm, rotary position embeddings (RoPE), SwiGLU (or GPT's GELU) MLP and grouped-query attention,
optionally with the output head tied to the token embedding. The module is written for a single
device and imports nothing from torch's distributed package: every parallelism is applied from
outside (``loom.parallel``). Three seams make that possible:

* layers live in a ``ModuleDict`` keyed by their *global* index, and the embedding, the final norm
  and the output head are optional, so a pipeline stage can hold any contiguous slice of the model
  and parameter names stay the same under every layout (which is what makes seeded initialisation
  and checkpoints layout-independent);
* attention reshapes with ``-1`` heads, so tensor parallelism can shard the projections by heads
  without touching this file;
* ``Attention.core`` (causal attention of ``[B, N, S, Hd]`` queries on ``[B, K, S, Hd]`` keys and
  values, K dividing N: the key/value heads are *not* repeated yet, so a distributed core can move
  K heads instead of N) is an attribute that context parallelism can swap for a distributed
  implementation, and ``forward`` takes explicit token ``positions`` so RoPE stays correct when
  the sequence is sharded.

A fourth seam is the feed-forward: with ``n_experts > 0`` the MoE layers (``moe_layer``) use
``loom.models.moe.MoEFeedForward``, whose expert computation is a swappable ``dispatcher`` (expert
parallelism replaces it); its load-balancing loss is read through ``Transformer.moe_aux_loss()``.

Shape letters: ``loom.models.layers``' legend.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Iterable

import torch
from torch import nn

from loom.models.document_attention import DocumentMask
from loom.models.layers import Attention, FeedForward, TransformerArgs, rope_tables_for
from loom.models.moe import MoEFeedForward
from loom.models.norm import RMSNorm


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, args: TransformerArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        if args.moe_layer(layer_id):
            self.feed_forward: nn.Module = MoEFeedForward(args)
        else:
            self.feed_forward = FeedForward(args)

    def forward(self, x_BSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor,
                documents: DocumentMask | None = None) -> torch.Tensor:
        # documents by keyword: tensor parallelism's input plans take exactly (x, cos, sin)
        h = x_BSD + self.attention(self.attention_norm(x_BSD), cos_SH, sin_SH,
                                   documents=documents)
        if documents is not None and isinstance(self.feed_forward, MoEFeedForward):
            # MoE routes and balances each document as its own group, padding nowhere
            return h + self.feed_forward(self.ffn_norm(h), documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A decoder, or any contiguous slice of one (a pipeline stage).

    ``layer_ids`` selects which global layers this module holds; ``with_embedding`` and
    ``with_head`` (final norm + output projection) say whether the ends are included. The input is
    token ids when the embedding is present, else hidden states ``[B, S, D]``; the output is logits
    ``[B, S, V]`` when the head is present, else hidden states.

    Packed rows (``data.packing = "pack"``) pass ``document_ids`` ``[B, S]`` (a document is a
    run of equal ids; ``loom.data.packing``): attention then never crosses a document boundary
    (``loom.models.document_attention``), and RoPE takes ``positions`` ``[B, S]``, which restart
    at 0 at each document (derived from the ids when not given). Without ``document_ids`` the
    model is the plain causal one, unchanged.

    ``head_in_vocab_shards`` is False here; a vocabulary-parallel pipeline
    (``loom.pipeline.stage.build_stages``) sets it True on the last stage, whose head then runs as
    the pipeline's vocabulary shards and whose ``output`` is an ``nn.Identity``.
    """

    def __init__(
        self,
        args: TransformerArgs,
        *,
        layer_ids: Iterable[int] | None = None,
        with_embedding: bool = True,
        with_head: bool = True,
    ) -> None:
        super().__init__()
        self.args = args
        layer_ids = range(args.n_layers) if layer_ids is None else list(layer_ids)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) if with_embedding else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in layer_ids})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps) if with_head else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if with_head else None
        if args.tie_embeddings and with_embedding and with_head:
            self.output.weight = self.tok_embeddings.weight
        self.head_in_vocab_shards = False
        # RoPE tables are derived data, not state: rebuilt by reset_parameters after meta init.
        cos, sin = rope_tables_for(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        documents = None
        if document_ids is not None:
            if document_ids.shape != h.shape[:2]:
                raise ValueError(f"document_ids shape {tuple(document_ids.shape)} does not match"
                                 f" the input's [batch, seq] = {tuple(h.shape[:2])}")
            documents = DocumentMask(document_ids, positions)
        if positions is None and documents is not None:
            positions = documents.positions()
        if positions is None:
            cos, sin = self.rope_cos[: h.shape[1]], self.rope_sin[: h.shape[1]]
        else:  # a shard of the sequence (context parallelism) knows its global positions;
            # packed rows give each row its own ([B, S]: restarting at each document)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin, documents=documents)
        if self.norm is not None:
            h = self.output(self.norm(h))
        return h

    def moe_aux_loss(self) -> torch.Tensor:
        """Sum over this module's MoE layers of the load-balancing loss of the last forward.

        The training loss is ``cross_entropy + args.aux_loss_coef * model.moe_aux_loss()``; call
        it after each forward (each microbatch). Zero for a dense model or slice.
        """
        losses = [layer.feed_forward.aux_loss for layer in self.layers.values()
                  if getattr(layer.feed_forward, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.rope_cos.device)


def _param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed: the same name gets the same numbers on every rank and layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def initial_value(name: str, shape: torch.Size, args: TransformerArgs, seed: int) -> torch.Tensor:
    """The full initial value of the parameter called ``name`` (fp32, on the CPU).

    Norm weights are ones and biases (``qkv_bias``) zeros; embeddings and projections are
    N(0, 0.02); the two projections that write into the residual stream (``wo``, ``w2``) use
    0.02 / sqrt(2 * n_layers) as in GPT-2, so the residual variance does not grow with depth.
    """
    if name.endswith("norm.weight"):  # q_norm / k_norm (qk_norm) included
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = 0.02
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2",
                      "feed_forward.shared.w2.weight")):
        std = 0.02 / math.sqrt(2 * args.n_layers)
    generator = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.randn(shape, generator=generator) * std


def seeded_name(name: str, args: TransformerArgs) -> str:
    """The name whose seed initialises parameter ``name``. A tied head is the embedding: a
    pipeline's last stage holds its own copy of it (no embedding there), and that copy must
    start from the embedding's value on the first stage."""
    return "tok_embeddings.weight" if args.tie_embeddings and name == "output.weight" else name


def reset_parameters(
    model: Transformer,
    seed: int,
    load: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
) -> None:
    """Initialise every parameter from ``initial_value`` and rebuild the RoPE tables in place.

    ``load(param, full_value)`` writes a full CPU tensor into a parameter; parallel wrappers pass
    one that keeps only their shard, so the weights are bit-identical under every layout.
    """
    load = load or (lambda param, value: param.copy_(value))
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are yielded once
            load(param, initial_value(seeded_name(name, model.args), param.shape, model.args,
                                      seed))
        if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
            model.output.weight = model.tok_embeddings.weight  # Module.to_empty() unties them
        cos, sin = rope_tables_for(model.args)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)


def build_model(
    args: TransformerArgs,
    *,
    device: torch.device | str = "meta",
    layer_ids: Iterable[int] | None = None,
    with_embedding: bool = True,
    with_head: bool = True,
) -> Transformer:
    """Construct the module (default: on the meta device, so no memory is touched)."""
    with torch.device(device):
        return Transformer(args, layer_ids=layer_ids, with_embedding=with_embedding,
                           with_head=with_head)
