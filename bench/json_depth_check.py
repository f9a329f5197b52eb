"""The cost of refusing deeply nested JSON lines before pyarrow reads them (docs/benchmarks.md).

``loom.data.sources`` scans a JSON-lines source for lines nested past ``MAX_JSON_DEPTH`` before
pyarrow's reader (which segfaults on them) sees the file. This writes ~100 MB of JSON lines, the
standard library's ``.py`` files as records (a code corpus: brackets everywhere, in strings),
and times the scan beside pyarrow's own parse of the same file, alternating, three times each.

    python bench/json_depth_check.py [--mb 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow.json as pa_json

from loom.data.sources import _check_json_depth, resolve_source


def write_corpus(path: Path, megabytes: float) -> None:
    texts = [p.read_text(errors="replace")
             for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]
    written = 0
    with open(path, "w") as out:
        while written < megabytes * 1e6:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line)
                if written >= megabytes * 1e6:
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        write_corpus(path, args.mb)
        source = resolve_source(str(path))
        times: dict[str, list[float]] = {"depth scan": [], "pyarrow read_json": []}
        for _ in range(3):
            start = time.perf_counter()
            _check_json_depth(source)
            times["depth scan"].append(time.perf_counter() - start)
            start = time.perf_counter()
            pa_json.read_json(path)
            times["pyarrow read_json"].append(time.perf_counter() - start)
        size = path.stat().st_size / 1e6
        for name, seconds in times.items():
            print(f"{name:18s} {size:.0f} MB: median {statistics.median(seconds):.3f} s"
                  f" (runs {', '.join(f'{s:.3f}' for s in seconds)})")


if __name__ == "__main__":
    main()
