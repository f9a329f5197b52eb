"""``bench/data_prepare.py`` runs end to end on a small corpus (slow: excluded from CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_prepare_benchmark_runs_and_agrees_with_transformers(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    out = tmp_path / "data_prepare.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "data_prepare.py"), "--mb", "1",
                           "--repeats", "1", "--vocab", "2048", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]  # the script asserts equal token counts
    result = json.loads(out.read_text())
    assert [r["method"].split(",")[0] for r in result["rows"][:3]] == [
        "loom data prepare", "loom data prepare", "transformers PreTrainedTokenizerFast loop"]
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
