"""Priced effect of the Zeppelin candidates' attention unit on the cp runtime (issue 17).

``loom.parallel.zeppelin_placement.place_over_cp`` sizes its candidates with the planner
(``loom.data.zeppelin``, attention per token²) from costs counted per query-key pair
(``model_token_costs``), converted by ``per_token_square``. This prices, with the runtime's own
cost model (``cp_step_price``; no run is timed), the placement chosen per microbatch with the
conversion and without it (attention weighed 2x in the sizing), and static cp over all ranks,
summed over the first ``--microbatches`` microbatches of ``--draws`` long-context corpora as
``bench/varlen.py --corpora longtail-long`` draws them (log-normal lengths, median 256, sigma
1.5, capped at 32x; whole documents in 8,192-token budgets), on the tiny model.

    python bench/zeppelin_sizing.py [--draws 6] [--microbatches 200] [--cp 4]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from loom.data.zeppelin import Ranks, partition_static_cp, zeppelin_candidates
from loom.models import preset
from loom.parallel.zeppelin_placement import (cp_step_price, model_token_costs,
                                              per_token_square)

MEDIAN, SIGMA, BUDGET = 256, 1.5, 8192


def microbatches(seed: int, count: int) -> list[list[int]]:
    """Whole documents, in order, filling ``BUDGET``-token microbatches."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(MEDIAN), SIGMA, 40 * count), 2, 32 * MEDIAN)
    batches, current = [], []
    for n in lengths.astype(int).tolist():
        if current and sum(current) + n > BUDGET:
            batches.append(current)
            current = []
        current.append(n)
    return batches[:count]


def chosen_price(seqs: list[int], cp: int, costs, sizing) -> float:
    ranks = Ranks(cp, per_node=cp)
    candidates = [replace(plan, costs=costs) for remap in (False, True)
                  for plan in zeppelin_candidates(seqs, ranks, sizing, remap=remap)]
    candidates.append(partition_static_cp(seqs, ranks, cp, costs))
    return min(cp_step_price(plan) for plan in candidates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=200)
    parser.add_argument("--cp", type=int, default=4)
    args = parser.parse_args()
    costs = model_token_costs(replace(preset("tiny"), max_seq_len=BUDGET))
    print("| draw | converted | unconverted / converted | static cp / converted |")
    print("|---|---|---|---|")
    for seed in range(args.draws):
        batches = microbatches(seed, args.microbatches)
        converted = sum(chosen_price(b, args.cp, costs, per_token_square(costs)) for b in batches)
        unconverted = sum(chosen_price(b, args.cp, costs, costs) for b in batches)
        static = sum(cp_step_price(partition_static_cp(b, Ranks(args.cp, per_node=args.cp),
                                                       args.cp, costs)) for b in batches)
        print(f"| {seed} | {converted:.4g} | {unconverted / converted:.4f} |"
              f" {static / converted:.4f} |")


if __name__ == "__main__":
    main()
