"""The FP8 casts the cost model charges a compiled stack (``FP8_WEIGHT_GRADIENT``'s compiled
column), against the graphs ``torch.compile`` makes of torchao's ``Float8Linear`` on this
machine (emulated FP8, AOTAutograd with inductor's min-cut partitioner).

Each dynamic cast reduces its tensor first (its amax: ``max`` under tensorwise, ``amax`` along
an axis under rowwise). Counting those reductions in the forward and backward graphs, apart
from the weight's (its casts are priced with the parameters, not per token), gives the casts of
activations and gradients one linear makes per microbatch. The cost model charges one in the
forward (the input), one in the input gradient (the output gradient) and the weight
gradient's compiled count: the graphs must make exactly as many."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from loom.sim.fp8_cost import FP8_WEIGHT_GRADIENT

torch = pytest.importorskip("torch")
float8 = pytest.importorskip("torchao.float8")


def _root(node):
    """The graph input a value is computed from, following first arguments."""
    while node.op != "placeholder":
        node = node.args[0]
    return node.name


def compiled_activation_casts(recipe: str) -> int:
    """Reductions in the compiled forward and backward graphs of one 64 x 64 Float8Linear whose
    tensor does not come from the weight (``primals_1``)."""
    from torch._functorch.aot_autograd import aot_module_simplified  # (torch's own compiler
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # pieces)
    graphs = {}

    def keep(tag):
        def compiler(gm, _):
            graphs[tag] = gm
            return gm
        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                                     partition_fn=min_cut_rematerialization_partition)

    layer = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe),
                                 emulate=True)
    float8.convert_to_float8_training(layer, config=config)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(layer, backend=backend)
        compiled(torch.randn(32, 64, requires_grad=True)).sum().backward()
    casts = 0
    for gm in graphs.values():
        for node in gm.graph.nodes:
            reduction = node.op == "call_function" and str(node.target).split(".")[-2] in (
                "max", "amax")
            if reduction and _root(node) != "primals_1":
                casts += 1
    return casts


@pytest.mark.parametrize("recipe", sorted(FP8_WEIGHT_GRADIENT))
def test_a_compiled_linear_casts_as_often_as_the_cost_model_charges(recipe):
    """tensorwise 3 (the input for the output and again for the weight gradient: a reshape
    keeps the graph's CSE from merging them; the output gradient once), rowwise 4 (both twice,
    along each axis), rowwise_with_gw_hp 2 (the weight gradient in 16 bits, uncast)."""
    _, _, compiled_w = FP8_WEIGHT_GRADIENT[recipe]
    assert compiled_activation_casts(recipe) == 1 + 1 + compiled_w
