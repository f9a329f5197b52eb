"""Benchmark: wall time of the ``loom schedule search`` command, start-up included (issue 22).

The targets: at most 1 s for p = 32, m = 256 and 5 s for p = 64, m = 512. Each case runs the
command as a fresh process (``python -m loom schedule search ...``, so the interpreter's and
Loom's imports count) ``--repeats`` times and reports the median wall time and the output's
digest. With ``--baseline DIR`` an older checkout (DIR on ``PYTHONPATH``) runs the same cases in
the same loop, alternating with this one, so both see the same machine load, and the digests
show whether both printed the same result. Default effort; the limit is 2p (Benchmark A's
target cells) with its hardest cost profile and with the default costs.

    python bench/search_time.py [--repeats 5] [--baseline /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [  # (p, m, costs, limit)
    (32, 256, "1,1,0.5,0.05", 64), (32, 256, "1,1,1", 64),
    (64, 512, "1,1,0.5,0.05", 128), (64, 512, "1,1,1", 128),
]


def run(source: str, p: int, m: int, costs: str, limit: int) -> tuple[float, str]:
    """Wall seconds and the sha256 of stdout of one ``loom schedule search`` run from ``source``."""
    command = [sys.executable, "-m", "loom", "schedule", "search", "--pp", str(p), "-m", str(m),
               "--costs", costs, "--memory-limit", str(limit), "--json"]
    env = {**os.environ, "PYTHONPATH": source}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=source, capture_output=True, check=True)
    return time.perf_counter() - start, hashlib.sha256(done.stdout).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="an older checkout to time beside this one")
    args = parser.parse_args()
    sources = {"this": ROOT, **({"baseline": args.baseline} if args.baseline else {})}
    print("| case | " + " | ".join(f"{name} median s (runs)" for name in sources) + " | same output |")
    print("|---|" + "---|" * (len(sources) + 1))
    for p, m, costs, limit in CASES:
        times: dict[str, list[float]] = {name: [] for name in sources}
        digests: dict[str, set[str]] = {name: set() for name in sources}
        for _ in range(args.repeats):
            for name, source in sources.items():
                seconds, digest = run(source, p, m, costs, limit)
                times[name].append(seconds)
                digests[name].add(digest)
        cells = [f"{statistics.median(t):.2f} ({', '.join(f'{s:.2f}' for s in t)})"
                 for t in times.values()]
        same = len(set.union(*digests.values())) == 1
        print(f"| p={p} m={m} costs {costs} limit {limit} | " + " | ".join(cells)
              + f" | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
