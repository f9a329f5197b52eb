"""Training loop, optimizer, checkpointing and metrics."""
