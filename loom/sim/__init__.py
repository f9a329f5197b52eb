"""The planner's cost model: a layout's step time and memory on a cluster, without accelerators.

``cost_model`` prices a step's time (compute, communication, the wrappers a layout runs
through, the pipeline's part in closed form), ``cost_memory`` the memory per rank. The schedule
replay itself lives in the torch-free ``loom.schedule`` (``simulate``).
"""
