"""The fuzz suite's hypothesis profiles: ``ci`` (default: bounded, derandomized, no example
database written into the repo) and ``bench`` (``bench/fuzz.py``; more examples, fresh ones each
run). ``HYPOTHESIS_PROFILE=bench pytest tests/fuzz`` runs the tests at the bench budgets."""

from __future__ import annotations

import os

from tests.fuzz import harness

harness.use_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
