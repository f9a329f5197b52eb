"""Wall time of the issue's five ``loom plan`` cases, whole command (start-up and imports included).

    python bench/planner_speed.py     # a markdown table on stdout
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

CASES = [  # model, GPUs, accelerator, seq, global batch in sequences
    ("llama3-8b", 8, "H100-SXM", 8192, 128),
    ("llama3-70b", 64, "H100-SXM", 8192, 512),
    ("llama3-70b", 512, "H100-SXM", 8192, 2048),
    ("gpt3-175b", 1024, "A100-80GB", 2048, 1536),
    ("gpt-1t", 3072, "A100-80GB", 2048, 3072),
]


def main() -> int:
    print("| model | GPUs | accelerator | seq x batch | layouts searched | best layout | wall time (s) |")
    print("|---|---|---|---|---|---|---|")
    for model, gpus, gpu, seq, batch in CASES:
        cmd = [sys.executable, "-m", "loom", "plan", "--model", model, "--gpus", str(gpus),
               "--gpu", gpu, "--seq", str(seq), "--global-batch-tokens", str(seq * batch),
               "--top", "5"]
        start = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - start
        lines = out.splitlines()
        searched = next(line for line in lines if line.startswith("searched")).split()[1]
        best = next((line[4:62].strip() for line in lines if line.startswith(" 1  ")), "none")
        print(f"| {model} | {gpus} | {gpu} | {seq} x {batch} | {searched} | {best} | {wall:.1f} |",
              flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
