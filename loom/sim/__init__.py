"""The planner's cost model: a layout's step time and memory on a cluster, without accelerators.

``layout`` is the planner's layout record, ``cost_model`` prices compute and communication,
``cost_pipeline`` the pipeline's part, ``cost_memory`` the memory per rank. The schedule replay
itself lives in the torch-free ``loom.schedule`` (``simulate``).
"""
