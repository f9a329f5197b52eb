"""Wall and CPU time of the issue's ``loom plan`` cases, whole command (start-up and imports
included): its five required ones and the 405B-on-16,384-H100 one.

    python bench/planner_speed.py     # a markdown table on stdout

CPU time (the command's user + system seconds) is the steadier figure on a shared machine: wall
time grows with the load average, which the table's footer reports.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

CASES = [  # model, GPUs, accelerator, seq, global batch in sequences
    ("llama3-8b", 8, "H100-SXM", 8192, 128),
    ("llama3-70b", 64, "H100-SXM", 8192, 512),
    ("llama3-70b", 512, "H100-SXM", 8192, 2048),
    ("gpt3-175b", 1024, "A100-80GB", 2048, 1536),
    ("gpt-1t", 3072, "A100-80GB", 2048, 3072),
    ("llama3-405b", 16384, "H100-SXM", 8192, 2048),
]


def main() -> int:
    print("| model | GPUs | accelerator | seq x batch | layouts searched | best layout"
          " | wall time (s) | CPU time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for model, gpus, gpu, seq, batch in CASES:
        cmd = [sys.executable, "-m", "loom", "plan", "--model", model, "--gpus", str(gpus),
               "--gpu", gpu, "--seq", str(seq), "--global-batch-tokens", str(seq * batch),
               "--top", "5"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        lines = out.splitlines()
        searched = next(line for line in lines if line.startswith("searched")).split()[1]
        best = next((line[4:62].strip() for line in lines if line.startswith(" 1  ")), "none")
        print(f"| {model} | {gpus} | {gpu} | {seq} x {batch} | {searched} | {best} | {wall:.1f}"
              f" | {cpu:.1f} |", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
