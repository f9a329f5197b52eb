"""The fuzz suite (tests/fuzz) at the ``bench`` profile: 1,000+ examples across the strategies,
counted per category as tried / exit 0 / exit 2 / known bug / other, with examples of "other".

    python bench/fuzz.py [--profile bench|ci] [--only config,toml,data,checkpoint,plan] [--strict]

"exit 0" is a success (``loom train`` exit 0, a library call that returned), "exit 2" a clean
refusal (exit 2 with one line and nothing written, ``ConfigError``, ``CheckpointError``);
"other" is anything else (a traceback, another exit code, a file written on a refusal or outside
the run directory, a checkpoint that loaded different content, code that ran). "known" are the
"other" outcomes of the bugs listed in ``tests/fuzz/harness.py`` (KNOWN_BUGS). Writes
``bench/out/fuzz.json``. Examples are fresh each run (the bench profile is not derandomized).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

MODULES = {
    "config": "tests.fuzz.test_fuzz_config",
    "toml": "tests.fuzz.test_fuzz_toml",
    "data": "tests.fuzz.test_fuzz_data",
    "checkpoint": "tests.fuzz.test_fuzz_checkpoint",
    "plan": "tests.fuzz.test_fuzz_plan",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="bench", choices=["bench", "ci"])
    parser.add_argument("--only", default=",".join(MODULES),
                        help="comma-separated subset of " + ", ".join(MODULES))
    parser.add_argument("--skip-train", action="store_true",
                        help="leave out the real training runs (seconds each)")
    parser.add_argument("--strict", action="store_true", help="count known bugs as other")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "fuzz.json"))
    args = parser.parse_args()
    if args.strict:
        os.environ["LOOM_FUZZ_STRICT"] = "1"

    import torch

    torch.set_num_threads(1)
    from tests.fuzz import harness

    harness.use_profile(args.profile)
    harness.RECORDER.raise_on_other = False  # count, don't stop
    seconds: dict[str, float] = {}
    for name in args.only.split(","):
        module = importlib.import_module(MODULES[name])
        for test_name in sorted(dir(module)):
            test = getattr(module, test_name)
            if not test_name.startswith("test_") or not hasattr(test, "hypothesis"):
                continue  # the explicit regression cases are pytest's
            if args.skip_train and "train_and_exit_0" in test_name:
                continue
            t0 = time.monotonic()
            try:
                test()
            except Exception as exc:  # noqa: BLE001 - an error of the harness itself
                print(f"{test_name}: harness error {type(exc).__name__}: {exc}", file=sys.stderr)
            seconds[test_name] = round(time.monotonic() - t0, 1)
            print(f"{test_name}: {seconds[test_name]} s", flush=True)

    print()
    print(harness.summary_table())
    total = sum(t.tried for t in harness.RECORDER.tallies.values())
    print(f"{'total':<22} {total:>6}")
    report = {"profile": args.profile, "seconds": seconds, "total": total, "categories": {}}
    for category, tally in sorted(harness.RECORDER.tallies.items()):
        signatures = Counter(last for _, last, _ in tally.examples)
        report["categories"][category] = {
            "tried": tally.tried, "exit0": tally.kinds["ok"], "exit2": tally.kinds["refused"],
            "known_bug": tally.kinds["known-bug"], "other": tally.kinds["other"],
            "examples": [{"input": i, "last_line": last, "known_bug": bug}
                         for i, last, bug in tally.examples]}
        if tally.examples:
            print(f"\n{category}: examples of 'other' / known bugs")
            for (inp, last, bug) in tally.examples[:8]:
                print(f"  [{bug or 'NEW'}] {last}\n      input: {inp[:300]}")
            if len(signatures) > 1:
                print(f"  distinct last lines: {len(signatures)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(f"\nwrote {args.out}")
    new = sum(t.kinds["other"] for t in harness.RECORDER.tallies.values())
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
