"""The ground floor's formulas: pure functions of sizes, no torch, no other Loom package.

``memory``: per-rank bytes of one layer's activations, the head, the ZeRO model state and the
step's transient buffers, with the two communication constants they depend on (``BUCKET_BYTES``,
``MAX_IN_FLIGHT``), which the data-parallel reducers import from here. ``flops``: model FLOPs per
trained token (MoE layers by their active experts). The launch-time estimator and MFU
(``loom.train``) and the planner's cost model (``loom.sim``) both read them, so the trainer and
the planner cannot disagree on a formula.
"""
