"""Search results over a fixed grid, dumped as JSON, to prove a speed change changes no result.

Runs ``loom.schedule.search.search`` in-process over 116 cases (p 2-16 with m p..4p, three
limits and three cost profiles; p = 16 and 32 at m = 8p; each placement at p = 8; a chunk cap)
and writes every winner's name, makespan, leaderboard, candidate count, placement and actions.
Run it on two checkouts and compare the files byte for byte (docs/benchmarks.md, "Search time,
fourth pass"):

    PYTHONPATH=OLD python bench/search_grid.py old.json
    PYTHONPATH=NEW python bench/search_grid.py new.json && cmp old.json new.json
"""

from __future__ import annotations

import json
import sys
import time

from loom.schedule.cost import parse_cost_spec
from loom.schedule.search import search


def cases() -> list[tuple[int, int, int, str, str, int]]:
    grid = [(p, m, limit, cost, "any", 8)
            for p in (2, 4, 8, 16) for m in (p, 2 * p, 4 * p)
            for limit in (p, 2 * p, max(1, p // 2))
            for cost in ("1,1,1", "1,2,1,0.1", "1,1.5,0.8,0.05")]
    for p, m in ((32, 256), (16, 128)):
        grid += [(p, m, p, "1,2,1,0.1", "any", 8), (p, m, 2 * p, "1,1,1", "any", 8)]
    grid += [(8, 32, 8, "1,2,1,0.1", placement, 8) for placement in ("v", "interleaved", "looped")]
    return grid + [(8, 32, 8, "1,2,1,0.1", "any", 3)]


def main() -> None:
    out = {}
    start = time.perf_counter()
    for case in cases():
        p, m, limit, cost, placement, max_chunks = case
        found = search(p, m, parse_cost_spec(cost), limit, placement, max_chunks=max_chunks)
        out[repr(case)] = {"name": found.schedule.name,
                           "makespan": str(found.sim_result.makespan),
                           "leaderboard": repr(found.leaderboard),
                           "tried": found.candidates_tried,
                           "placement": list(found.schedule.placement),
                           "actions": [[str(a) for a in row] for row in found.schedule.actions]}
    print(f"{len(out)} cases in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    with open(sys.argv[1], "w") as handle:
        json.dump(out, handle, sort_keys=True)


if __name__ == "__main__":
    main()
