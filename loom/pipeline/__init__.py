"""Pipeline parallelism on torch: the stages, the runtime that executes a schedule, profiling.

The schedules themselves (IR, validator, families, search, simulation) are data in the
torch-free ``loom.schedule``; this package runs them: ``partition`` splits the layers over
stages, ``stage`` builds a stage module, ``runtime`` executes a schedule's actions with
point-to-point transfers, ``profile`` measures the real per-stage costs for the simulator, and
``cli`` is ``loom schedule``.
"""
