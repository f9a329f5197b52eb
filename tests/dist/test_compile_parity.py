"""``train.compile = true`` (torch.compile per transformer block) gives one eager process's loss
and gradients, alone and composed with FSDP2 (ZeRO-3), tensor parallelism, a 1F1B pipeline and
full activation recomputation, through the real Trainer; so do MoE models (the MoE layer eager)
and varlen microbatches (compiled for any length).

Same model (debug preset, 4 query and 4 key/value heads so tp = 2 fits), seed and data as
test_layouts_parity.py; 2 optimizer steps (inductor on 2 CPU cores is the slow part), fp32.
Every candidate is compared with the *eager* one-process reference, so a test checks both the
compiled kernels and the layout at once.

Tolerance: inductor fuses the block's pointwise ops and reductions (RMSNorm, RoPE, SwiGLU) and
computes them in another order and with fused multiply-adds, so gradients differ from eager's by
a few float32 ulps (measured: about 1e-7 relative on the debug model); that is below the
tolerances the other parity tests already state for a changed summation order (1e-5 / 1e-6 at
step 1, 1e-4 / 1e-5 after Adam's amplification), which are used here unchanged.

Each task resets dynamo first: the workers are long-lived, and a compiled code object (every
block shares ``nn.Module._call_impl``) that had collected earlier tests' guards could reach
dynamo's recompile limit and quietly run eagerly. The task then reports how many graphs dynamo
compiled, and the test requires some, so an eager fallback cannot pass for a compiled run.
"""

import pytest
import torch
import torch._dynamo

from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES, matrix

STEPS = 2
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "model.n_kv_heads": 4,
        "train.steps": STEPS, "train.global_batch_size": 8, "train.micro_batch_size": 2,
        "optim.warmup_steps": 1, "optim.lr": 1e-3, "train.grad_clip": 1.0}
COMPILED = {**BASE, "train.compile": True}
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5

LAYOUTS = {  # name: (world, parallel degrees and knobs, other overrides)
    "single": (1, {}, {}),
    "zero3-dp_shard2": (2, {"dp_shard": 2, "zero_stage": 3}, {}),
    # no SP: the first block's input is a DTensor.to_local() view (compile.py's _fresh_views)
    "tp2": (2, {"tp": 2}, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, {}),
    "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b"}, {}),
    "recompute-full": (1, {}, {"train.recompute": "full"}),
}


def record_compiled(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``record_training`` from a fresh dynamo cache, plus the number of graphs compiled."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: count this task's graphs only
    record = record_training(ctx, config_table, data_dir, steps)
    record["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return record


@pytest.fixture(scope="module")
def reference(dist, small_data_dir):
    return dist.run(1, record_training, layout_config(BASE, 1), small_data_dir, STEPS)[0]


# CI: one process and the pipeline; ZeRO-3 (the compiled blocks under FSDP2's hooks) and tp in
# the matrix
@pytest.mark.parametrize("layout", matrix(LAYOUTS, ci=[name for name in LAYOUTS
                                                       if name not in ("tp2-sp", "tp2",
                                                                       "zero3-dp_shard2")]))
def test_compiled_layout_matches_eager_one_process(dist, small_data_dir, reference, layout):
    world, parallel, overrides = LAYOUTS[layout]
    config = layout_config({**COMPILED, **overrides}, world, **parallel)
    results = dist.run(world, record_compiled, config, small_data_dir, STEPS)
    for rank, result in enumerate(results):
        label = f"compiled {layout} rank {rank}"
        assert result["graphs"] > 0, f"{label}: dynamo compiled nothing (an eager fallback)"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)


# -- MoE: the attention and norms compiled block by block, the MoE layer eager ------------------
MOE = {"model.n_experts": 4, "model.top_k": 2}
MOE_LAYOUTS = {"moe-single": (1, {}), "moe-ep2": (2, {"ep": 2})}


@pytest.fixture(scope="module")
def moe_reference(dist, small_data_dir):
    return dist.run(1, record_training, layout_config({**BASE, **MOE}, 1), small_data_dir,
                    STEPS)[0]


def compiled_moe_modules(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``record_compiled``, plus which modules of each block got a compiled forward."""
    from loom.config import from_dict
    from loom.models.moe import MoEFeedForward
    from loom.testing.parity import train_and_record
    from loom.train.trainer import Trainer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    compiled = sorted({name for block in trainer.model.layers.values()
                       for name, module in [("block", block), *block.named_children()]
                       if "forward" in vars(module)})
    moe_eager = all("forward" not in vars(b.feed_forward) for b in trainer.model.layers.values()
                    if isinstance(b.feed_forward, MoEFeedForward))
    record = train_and_record(trainer, steps)
    record["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    record["compiled"], record["moe_eager"] = compiled, moe_eager
    return record


# CI: one process (ep2 in the matrix: the same per-block split under ep's all-to-all)
@pytest.mark.parametrize("layout", matrix(MOE_LAYOUTS, ci=["moe-single"]))
def test_compiled_moe_matches_eager_one_process(dist, small_data_dir, moe_reference, layout):
    world, parallel = MOE_LAYOUTS[layout]
    config = layout_config({**COMPILED, **MOE}, world, **parallel)
    for rank, result in enumerate(dist.run(world, compiled_moe_modules, config, small_data_dir,
                                           STEPS)):
        label = f"compiled {layout} rank {rank}"
        assert result["compiled"] == ["attention", "attention_norm", "ffn_norm"], label
        assert result["moe_eager"], label
        # one graph per compiled module shape, not one per batch: a compiled MoE layer would
        # add graphs step after step (measured: 2, at one rank and under ep2)
        assert 0 < result["graphs"] <= 4, f"{label}: {result['graphs']} graphs"
        assert_parity(moe_reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(moe_reference, result, rtol=RTOL, atol=ATOL, label=label)


# -- varlen: every microbatch its own length, compiled once for any length ----------------------
VARLEN_STEPS = 4
VARLEN_SEQ, VARLEN_BUDGET = 32, 48  # split length, tokens per microbatch (4 per step)


@pytest.fixture(scope="module")
def varlen_documents(tmp_path_factory) -> tuple[str, dict]:
    from tests.data_fixtures import prepared_documents

    data_dir, overrides = prepared_documents(tmp_path_factory, "compile_varlen_docs", VARLEN_SEQ,
                                             count=300, seed=23)
    overrides.update({"data.packing": "varlen", "data.tokens_per_microbatch": VARLEN_BUDGET,
                      "train.global_batch_tokens": 4 * VARLEN_BUDGET, "model.preset": "debug",
                      "train.steps": VARLEN_STEPS})
    return data_dir, overrides


def record_compiled_lengths(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """``record_compiled``, plus the length of every microbatch the steps ran."""
    from loom.config import from_dict
    from loom.testing.parity import train_and_record
    from loom.train.trainer import Trainer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    lengths: list[int] = []
    draw = trainer.loader.next_batch

    def next_batch():
        batch = draw()
        lengths.extend(mb.inputs.shape[1] for mb in batch.microbatches)
        return batch

    trainer.loader.next_batch = next_batch
    record = train_and_record(trainer, steps)
    record["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    record["lengths"] = lengths
    return record


VARLEN_LAYOUTS = {  # name: (world, parallel degrees, other overrides)
    "single": (1, {}, {}),
    "dp2": (2, {"dp_replicate": 2}, {}),
    "pp2": (2, {"pp": 2, "dp_replicate": 1}, {}),
    # context parallelism's core (and Zeppelin's, over cp or over dp) runs eagerly between the
    # compiled pieces: its document path splits by data-dependent sizes
    "cp2": (2, {"cp": 2, "dp_replicate": 1}, {"parallel.cp_mode": "ring"}),
    "zeppelin-dp2": (2, {"dp_replicate": 2}, {"data.balance": "zeppelin"}),
    "moe-ep2": (2, {"ep": 2, "dp_replicate": 1}, MOE),
    "recompute-selective": (1, {}, {"train.recompute": "selective"}),
    "recompute-full": (1, {}, {"train.recompute": "full"}),
    "zero3-dp_shard2": (2, {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3}, {}),
    "vocab-pp2": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.vocab_parallel_pp": True}),
}


@pytest.mark.parametrize("layout", matrix(VARLEN_LAYOUTS, ci=["single"]))
def test_compiled_varlen_matches_eager_and_compiles_once_for_every_length(dist, varlen_documents,
                                                                          layout):
    """More distinct microbatch lengths than dynamo's recompile limit (8), and a bounded number
    of graphs: the blocks are compiled for a symbolic length (measured: 6 graphs over 10
    lengths at one rank, the block and its attention split around the eager per-document
    kernel, 32 compiled for static shapes; 4 under cp2), not once per length."""
    data_dir, base = varlen_documents
    world, parallel, overrides = VARLEN_LAYOUTS[layout]
    model = {k: v for k, v in overrides.items() if k.startswith("model.")}
    reference = dist.run(1, record_training, layout_config({**base, **model}, 1), data_dir,
                         VARLEN_STEPS)[0]
    config = layout_config({**base, **overrides, "train.compile": True}, world, **parallel)
    results = dist.run(world, record_compiled_lengths, config, data_dir, VARLEN_STEPS)
    lengths = {n for result in results for n in result["lengths"]}
    assert len(lengths) > 8, sorted(lengths)
    for rank, result in enumerate(results):
        label = f"compiled varlen {layout} rank {rank}"
        assert 0 < result["graphs"] <= 8, f"{label}: {result['graphs']} graphs"
        assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=label,
                      steps=range(1))
        assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=label)


@pytest.mark.parametrize("recompute", matrix(["full", "none"], ci=["full"]))
def test_compiled_packed_rows_match_eager_with_their_attention_kernel_eager(
        dist, varlen_documents, recompute):
    """Rows of whole documents (``pack``): the per-document kernel runs eagerly, the rest of
    each block compiles; under full recomputation inside its checkpoint (traced with the
    checkpoint, the block ran wholly eager: 0 graphs; measured 5 now)."""
    data_dir, base = varlen_documents
    base = {key: value for key, value in base.items()
            if key not in ("data.tokens_per_microbatch", "train.global_batch_tokens")}
    base.update({"data.packing": "pack", "train.global_batch_size": 8,
                 "train.micro_batch_size": 2, "train.recompute": recompute})
    reference = dist.run(1, record_training, layout_config(base, 1), data_dir, STEPS)[0]
    result = dist.run(1, record_compiled, layout_config({**base, "train.compile": True}, 1),
                      data_dir, STEPS)[0]
    assert 0 < result["graphs"] <= 8, result["graphs"]
    assert_parity(reference, result, rtol=RTOL_FIRST, atol=ATOL_FIRST, label=recompute,
                  steps=range(1))
    assert_parity(reference, result, rtol=RTOL, atol=ATOL, label=recompute)
