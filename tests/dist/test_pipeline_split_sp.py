"""Sequence parallelism inside a pipeline whose schedule splits the backward into I and W is one
process.

pp = 2 x tp = 2 with ``parallel.sequence_parallel``: the stages' parameters are DTensors, so the
stage takes the retaining I/W split (``loom.pipeline.stage``: torch's ``stage_backward_input`` /
``stage_backward_weight``). That W sets ``.grad`` itself and no post-accumulate hook fires, so
the norm weights (replicated, their input a sequence shard) used to keep a ``Partial`` gradient
that the clipping norm counted as replicated: the gradient norm, and with it every clipped
gradient, came out ~2e-5 (relative) off. The stage now gives each gradient its parameter's
placement after W, as B's hook does. For ZB-H1 and ZB-V (and, in the matrix, ZB-H2,
DualPipeV, the searched schedule and vocabulary parallelism across the pipeline with ZB-V),
three optimizer steps give the same loss, gradient norm and every parameter's gradient as one
process with the same global batch, then the same validation loss and saved weights, at
tests/dist/test_pipeline_parity.py's fp32 tolerances (the runs differ only in summation
order).
"""

from __future__ import annotations

import pytest

from loom.testing.parity import layout_config
from tests.conftest import matrix
from tests.dist.test_pipeline_parity import BASE, STEPS, check, record_pipeline, reference_runs

MICROBATCHES = 4  # per pipeline: valid for every family at p = 2 (DualPipeV needs 2p)
CASES = [  # (schedule, vocabulary parallel across the pipeline)
    ("zb_h1", False),
    ("zbv", False),
    ("zb_h2", False),
    ("dualpipev", False),
    ("search", False),  # the schedule search's pick (uniform costs, limit pp)
    ("zbv", True),
]


@pytest.fixture(scope="module")
def reference(dist, small_data_dir, tmp_path_factory) -> dict:
    """The one-process run every case compares with (the same global batch for all)."""
    runs = reference_runs(dist, small_data_dir, str(tmp_path_factory.mktemp("ref")), BASE, STEPS)
    return runs(MICROBATCHES)


@pytest.mark.parametrize("schedule, vocab", matrix(CASES, ci=[("zbv", False)]),
                         ids=[f"{s}{'-vocab' if v else ''}" for s, v in CASES])
def test_split_backwards_with_sequence_parallel_match_one_process(dist, small_data_dir,
                                                                  reference, tmp_path,
                                                                  schedule, vocab):
    pp, tp = 2, 2
    config = layout_config({**BASE, "train.global_batch_size": MICROBATCHES,
                            "parallel.schedule": schedule, "parallel.vocab_parallel_pp": vocab,
                            "parallel.sequence_parallel": True}, pp * tp, pp=pp, tp=tp)
    assert config["parallel"]["sequence_parallel"] is True
    results = dist.run(pp * tp, record_pipeline, config, small_data_dir, STEPS, str(tmp_path))
    check(reference, results, f"{schedule} pp={pp} tp={tp} sp{' vocab' if vocab else ''}")
