"""The ground-floor formulas are the one count every caller uses: the trainer's MFU numerator
and the planner's are the same number, MoE layers included (they used to disagree there)."""

import pytest

from loom.config import load_config, resolve
from loom.formulas.flops import model_flops_per_token, training_flops_per_token
from loom.models.presets import PRESETS
from loom.plan.hardware import make_cluster
from loom.sim.cost_model import CostModel
from loom.config import model_args


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "mixtral-8x7b", "deepseek-moe-16b"])
def test_the_planners_mfu_numerator_is_the_shared_count(preset):
    """The planner prices model FLOPs with the count the trainer's MFU uses
    (``Trainer.fit`` calls ``model_flops_per_token``), not a second formula of its own."""
    config = resolve(load_config(None, {"model.preset": preset, "data.seq_len": "256",
                                        "train.global_batch_size": "8",
                                        "train.skip_memory_check": "true"}), 1)
    args = model_args(config)
    planner = CostModel(args, 256, 8, make_cluster("H100-SXM", 8, 8))
    assert planner.model_flops_per_step() == 8 * 256 * model_flops_per_token(args, 256)


def test_moe_layers_count_their_active_experts_not_the_dense_width():
    common = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128,
                  vocab_size=100, seq_len=32)
    dense = training_flops_per_token(**common)
    moe = training_flops_per_token(**common, moe_layers=1, n_experts=8, top_k=2,
                                   expert_ffn_dim=32, n_shared_experts=1)
    # one layer's MLP: 3·h·f = 24576 weights dense; MoE: 3·h·32·(2+1) + h·8 = 18944 active
    assert dense - moe == 6 * (3 * 64 * 128 - (3 * 64 * 32 * 3 + 64 * 8))
    with pytest.raises(ValueError, match="moe_layers=3"):
        training_flops_per_token(**common, moe_layers=3)


def test_a_dense_model_counts_as_before():
    args = PRESETS["llama3-8b"]
    assert model_flops_per_token(args, 8192) == training_flops_per_token(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim, ffn_dim=args.ffn_dim, vocab_size=args.vocab_size, seq_len=8192)
