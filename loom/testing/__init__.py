"""Test infrastructure shipped with Loom so every later feature (and users' extensions) can prove
itself against one process: ``harness`` runs a function on W long-lived gloo ranks, ``parity``
trains a config on any layout and compares loss and every gradient with the one-process run."""
