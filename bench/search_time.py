"""Benchmark: wall time of the ``loom schedule search`` command, start-up included (issue 22).

The targets: at most 1 s for p = 32, m = 256 and 5 s for p = 64, m = 512. Each case runs the
command as a fresh process (``python -m loom schedule search ...``, so the interpreter's and
Loom's imports count) ``--repeats`` times and reports the median wall time, the median CPU
time of the process (user + system: what the machine's load does not inflate much) and the
output's digest. With ``--baseline DIR`` an older checkout (DIR on ``PYTHONPATH``) runs the same cases in
the same loop, alternating with this one, so both see the same machine load, and the digests
show whether both printed the same result. With ``--pure-python`` this checkout also runs with
``LOOM_PURE_PYTHON=1`` (the search's loops in Python rather than compiled,
``loom.schedule.compiled``). Default effort; the limit is 2p (Benchmark A's target cells) with
its hardest cost profile and with the default costs, plus F, I, W = 1, 2, 1 with latency 0.1 at
limits p and 2p (``--more``: the cells issue 22 names).

    python bench/search_time.py [--repeats 5] [--baseline /path/to/old/checkout] [--more]
                                [--pure-python]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [  # (p, m, costs, limit)
    (32, 256, "1,1,0.5,0.05", 64), (32, 256, "1,1,1", 64),
    (64, 512, "1,1,0.5,0.05", 128), (64, 512, "1,1,1", 128),
]
MORE = [(32, 256, "1,2,1,0.1", 32), (32, 256, "1,2,1,0.1", 64), (64, 512, "1,2,1,0.1", 64)]


def run(source: str, p: int, m: int, costs: str, limit: int, pure: bool = False
        ) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system) and the sha256 of stdout of one ``loom schedule
    search`` run from ``source`` (``pure``: with the Python loops)."""
    command = [sys.executable, "-m", "loom", "schedule", "search", "--pp", str(p), "-m", str(m),
               "--costs", costs, "--memory-limit", str(limit), "--json"]
    env = {**os.environ, "PYTHONPATH": source, "LOOM_PURE_PYTHON": "1" if pure else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=source, capture_output=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, hashlib.sha256(done.stdout).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="an older checkout to time beside this one")
    parser.add_argument("--more", action="store_true", help="also the F,I,W = 1,2,1 cells")
    parser.add_argument("--only-more", action="store_true", help="only the F,I,W = 1,2,1 cells")
    parser.add_argument("--pure-python", action="store_true",
                        help="also this checkout with LOOM_PURE_PYTHON=1")
    args = parser.parse_args()
    cases = MORE if args.only_more else CASES + MORE * args.more
    sources = {"this": (ROOT, False), **({"pure python": (ROOT, True)} if args.pure_python
                                         else {}),
               **({"baseline": (args.baseline, False)} if args.baseline else {})}
    print("| case | " + " | ".join(f"{name} median wall s (runs) | {name} median CPU s"
                                   for name in sources) + " | same output |")
    print("|---|" + "---|" * (2 * len(sources) + 1))
    for p, m, costs, limit in cases:
        times: dict[str, list[float]] = {name: [] for name in sources}
        cpus: dict[str, list[float]] = {name: [] for name in sources}
        digests: dict[str, set[str]] = {name: set() for name in sources}
        for _ in range(args.repeats):
            for name, (source, pure) in sources.items():
                seconds, cpu, digest = run(source, p, m, costs, limit, pure)
                times[name].append(seconds)
                cpus[name].append(cpu)
                digests[name].add(digest)
        cells = [f"{statistics.median(times[name]):.2f} "
                 f"({', '.join(f'{s:.2f}' for s in times[name])}) | "
                 f"{statistics.median(cpus[name]):.2f}" for name in sources]
        same = len(set.union(*digests.values())) == 1
        print(f"| p={p} m={m} costs {costs} limit {limit} | " + " | ".join(cells)
              + f" | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
