"""Measuring this machine for the planner: ``measure`` (matmuls, bandwidth, Loom's blocks, gloo
collectives) and ``probes`` (Loom's trainer under each parallel wrapper). A command-level
package: it runs torch and the trainer, and hands its raw numbers to ``loom.plan.calibrate``,
which fits and stores them; the planner itself only reads the stored profile.
"""
