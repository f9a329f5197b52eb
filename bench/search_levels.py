"""The schedule search at every activation limit, beside the families that fit the same memory.

For uniform per-stage costs F, I, W = 1, 1.2, 0.8 and latency 0.02, p = 4 and 8, m = 4p, on the
looped and the V placement: the searched schedule's makespan over the pure work m(F + I + W),
minus 1, at L = 1..2p units, then each family of the placement with its peak units and excess,
then how far the planner's screening estimate
(``loom.sim.pipeline_estimate.search_estimate``) is from the search at each L. The numbers
behind docs/planner.md's "What the search buys" table.

    python bench/search_levels.py      # about 25 s here
"""

from __future__ import annotations

from loom.schedule import families as schedules
from loom.schedule.search import placement_costs, search
from loom.schedule.validate import peak_memory
from loom.schedule.cost import StageCosts
from loom.layout import Layout
from loom.sim.pipeline_estimate import search_estimate
from loom.schedule.simulate import simulate

F, I, W, LATENCY = 1.0, 1.2, 0.8, 0.02
FAMILIES = {"looped": ("1f1b", "zb_h1", "zb_h2"), "v": ("zbv", "v_half", "v_min")}


def main() -> None:
    costs = StageCosts.uniform(F, I, W, LATENCY)
    for p in (4, 8):
        m = 4 * p
        work = m * (F + I + W)
        for placement, families in FAMILIES.items():
            v = 2 if placement == "v" else 1
            ops = [(F / v, I / v, W / v)] * (p * v)
            excess, errors = [], []
            for limit in range(1, 2 * p + 1):
                found = float(search(p, m, costs, limit, placement).best.makespan)
                excess.append(f"{limit}:{found / work - 1:.2f}")
                lay = Layout(pp=p, schedule="search", chunks=v, schedule_placement=placement,
                             microbatches=m, schedule_memory_limit=limit)
                estimate = search_estimate(lay, ops, F + I + W, LATENCY)
                errors.append(f"{limit}:{estimate / found - 1:+.0%}")
            print(f"p={p} m={m} {placement}: search excess by units  " + " ".join(excess))
            for name in families:
                schedule = schedules.get(name)(p, m)
                result = simulate(schedule, placement_costs(costs, schedule.placement))
                print(f"    {name}: {max(peak_memory(schedule)):g} units,"
                      f" excess {float(result.makespan) / work - 1:.3f}")
            print("    screening estimate vs search: " + " ".join(errors))


if __name__ == "__main__":
    main()
