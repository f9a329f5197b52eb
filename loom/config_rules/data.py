"""The data path's rules: packing modes, varlen's token budgets, documents on each layout.

``data.packing`` (concat, pack, varlen), ``data.balance``, the two token budgets and which
layouts carry documents (every axis since issue 17 items 2-3; what is still refused is named
here), and the BPE vocabulary a tokenizer needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.data.budgets import BALANCES, PACKINGS, token_budgets
from loom.errors import ConfigError, suggest

if TYPE_CHECKING:  # the rules read a config; loom.config imports them to run them in resolve()
    from loom.config import Config, DataConfig

from loom.config_rules.common import nearest_multiples


def check_bpe_vocab(data: DataConfig) -> None:
    if data.tokenizer == "bpe" and data.bpe_vocab_size < 260:
        raise ConfigError("data.bpe_vocab_size", data.bpe_vocab_size,
                          "must be >= 260 (256 byte symbols plus special tokens)")


def validate_packing(config: Config) -> None:
    """``data.packing``: a known mode; documents run on every axis, with mixed sources
    (``varlen.MixedPieces``: ``data.mix``'s weights as shares of tokens) and compiled blocks
    (varlen compiles them for any length, ``loom.parallel.compile``) (cp cuts them per
    document, ``loom.parallel.context_documents``, with sequence parallelism splitting a cp
    shard over tp unevenly; tp, selective recompute and MoE all run: the attention core sees
    whole rows, MoE routes and balances per document, padding excluded, its counts summed over
    the cp ranks holding a document's parts; outer dp modes count a step's tokens over a
    replica's dp_shard x ep x cp ranks)."""
    packing, tr = config.data.packing, config.train
    if packing not in PACKINGS:
        raise ConfigError("data.packing", packing, f"must be one of {', '.join(PACKINGS)}"
                          + suggest(str(packing), list(PACKINGS)))
    data = config.data
    for key, value in (("train.global_batch_tokens", tr.global_batch_tokens),
                       ("data.tokens_per_microbatch", data.tokens_per_microbatch)):
        if value < 0:
            raise ConfigError(key, value, "must be >= 0 (0: from the batch in sequences)")
        if value and packing != "varlen":
            raise ConfigError(key, value, "applies to data.packing = varlen only; leave it 0")
    if data.balance not in BALANCES:
        raise ConfigError("data.balance", data.balance, f"must be one of {', '.join(BALANCES)}"
                          + suggest(str(data.balance), list(BALANCES)))
    if data.balance != "none" and packing != "varlen":
        raise ConfigError("data.balance", data.balance, "deals the documents of varlen steps:"
                          " needs data.packing = varlen")
    if data.zeppelin_remap and data.balance != "zeppelin":
        raise ConfigError("data.zeppelin_remap", True, "remaps the tokens of Zeppelin's"
                          f" placement: needs data.balance = zeppelin (here {data.balance})")
    if packing == "concat":
        return
    if data.balance == "zeppelin":
        _validate_zeppelin(config)


def zeppelin_over_dp(config: Config) -> str | None:
    """Why ``data.balance = zeppelin`` places over the cp ranks of each data-parallel rank
    rather than over every dp x cp rank, or None where it places over dp x cp. The domain is
    built for a data-parallel degree > 1 (dp_replicate and dp_shard alike: ZeRO/FSDP shards
    parameters, not data) and synchronous data parallelism, with tp, pp and MoE: one
    domain per (tp, pp) coordinate, its sub-rings over the flattened dp x cp index of that
    coordinate, and every tp rank and stage of a domain rank computing the same placement
    (tests/dist/test_zeppelin_dp.py: dp x tp with sequence parallelism off and on, dp x pp
    with 1f1b and ZB-H1, dp x cp x tp, dp x cp x pp, dp x tp x pp, each as one process). MoE
    models run in it with or without ep (ep is a data axis, so the domain spans it): a
    document cut over domain ranks routes and balances as one routing group, its counts
    summed over the domain (``DocumentCountsSum`` on the domain group), and the ep all-to-all
    carries whatever token counts the placement gives each rank; dropless only, as with cp
    (``_validate_zeppelin``). Under an outer ``dp_mode`` each replica trains on its own share
    of the step, so the domain is one replica's dp_shard x ep x cp ranks (the replica's
    ``loom.topology`` mesh), which needs dp_shard x ep > 1; with one data rank per replica
    the placement runs over its cp ranks, as without dp."""
    par = config.parallel
    if par.dp_mode != "sync":  # the domain is one replica's data ranks (module docstring)
        if par.dp_shard * par.ep < 2:
            return (f"parallel.dp_mode = {par.dp_mode} places over one replica's data ranks, and"
                    f" a replica here has one (dp_shard x ep = {par.dp_shard * par.ep})")
        return None
    if par.dp < 2:
        return "one data-parallel rank"
    return None


def _validate_zeppelin(config: Config) -> None:
    """``data.balance = zeppelin`` places each varlen microbatch's documents over a domain of
    ranks (``loom.parallel.zeppelin_cp``): every dp x cp rank where ``zeppelin_over_dp`` allows
    (merged microbatches, sub-rings over the flattened dp x cp index, cp = 1 included; with tp
    and pp one domain per (tp, pp) coordinate, the schedule's microbatch count kept: a dp
    rank's bins, merged); otherwise the cp ranks of each data-parallel rank, which needs
    cp > 1. Either runs with tp (sequence parallelism on or off) and pp: every rank of a domain
    rank's tp group and pipeline computes the same placement; sub-rings per (tp, pp)
    coordinate (and per data coordinate over cp alone), like the cp ring. So does
    ``data.zeppelin_remap`` (the remapping layer): its all-to-alls run on the same domain
    group of the rank's (tp, pp) coordinate, each tp rank moving its shard of the heads of the
    linear shard every tp rank holds (SP splits it over tp around the blocks only, and the
    attention core sees it whole), each stage remapping inside its own attention layers and
    passing the linear shard on; nothing to refuse beyond ``balance = zeppelin``."""
    par = config.parallel
    if par.cp > 1 and par.cp_mode != "ring":
        raise ConfigError("parallel.cp_mode", par.cp_mode, "data.balance = zeppelin runs its"
                          " placement on the document ring: use cp_mode = ring")
    why_not_dp = zeppelin_over_dp(config)
    capacity = config.model.capacity_factor
    if why_not_dp is None and config.model.n_experts and capacity > 0:
        raise ConfigError("model.capacity_factor", capacity, "must be 0 (dropless) with"
                          " data.balance = zeppelin over the dp x cp ranks: capacity is per"
                          " document, and a queue position depends on the order of all of a"
                          " document's tokens, which the placement splits over ranks")
    if why_not_dp is not None and par.cp < 2:
        raise ConfigError("data.balance", "zeppelin", "places documents over the dp x cp ranks,"
                          f" or over the cp ranks with parallel.cp > 1; here cp = {par.cp} and"
                          f" the dp x cp domain is out: {why_not_dp}. Use tokens, or cp > 1")




def varlen_budgets(config: Config) -> tuple[int, int]:
    """``(train.global_batch_tokens, data.tokens_per_microbatch)`` with 0 resolved."""
    tr, data = config.train, config.data
    return token_budgets(tr.global_batch_tokens, data.tokens_per_microbatch,
                         tr.global_batch_size, tr.micro_batch_size, data.seq_len)


def validate_varlen_batch(config: Config) -> None:
    """Varlen's batch is in tokens: a microbatch holds any piece (``tokens_per_microbatch``
    >= ``seq_len``, the split length), and the step's microbatches ``global_batch_tokens /
    tokens_per_microbatch`` are shared equally by the data-parallel ranks."""
    par, data = config.parallel, config.data
    step, micro = varlen_budgets(config)
    if micro < data.seq_len:
        raise ConfigError("data.tokens_per_microbatch", micro,
                          f"must be >= data.seq_len = {data.seq_len}, the split length:"
                          " documents are cut into pieces of at most seq_len predictions and"
                          " each piece must fit in one microbatch")
    if step % (par.dp * micro):
        # Unset, the step's tokens come from the sequence counts: say so, or the line names a
        # field the user never wrote.
        derived = ("" if config.train.global_batch_tokens else
                   f"(unset: train.global_batch_size {config.train.global_batch_size} x"
                   f" data.seq_len {data.seq_len}) ")
        raise ConfigError("train.global_batch_tokens", step,
                          f"{derived}must be divisible by dp * data.tokens_per_microbatch ="
                          f" {par.dp} * {micro} (equal microbatch counts on every data-parallel rank);"
                          f" nearest valid: {nearest_multiples(step, par.dp * micro)}")


__all__ = ["check_bpe_vocab", "validate_packing", "varlen_budgets", "validate_varlen_batch"]
