"""``loom plan --length-dist FILE``: rank the balances of a variable-length step on a cluster.

A variable-length step's time depends on how its sequences are spread, not only on the layout's
degrees: the planner samples steps of ``--global-batch-tokens`` from the length distribution
(``loom.sim.varlen_cost.load_length_distribution`` defines the file) and prices every balance
(none, tokens, static cp over one node, Zeppelin with and without remapping) on all ``--gpus``
as data parallel x cp (tp = pp = 1), fastest first, with each one's attention and linear
imbalance (max / mean). Predictions of the cost model, never measurements; ``data.balance =
zeppelin`` trains only part of what is priced here (over cp ranks, on sub-rings, no
remapping: ``loom.data.zeppelin`` says what the runtime lacks).
"""

from __future__ import annotations

import json
from typing import Any

from loom.errors import ConfigError
from loom.sim.cost_model import CostModel
from loom.sim.varlen_cost import LengthDistribution, VarlenRanking, rank_balances

STEPS = 4  # sampled steps per balance (seeds 0..3)


def table(ranking: VarlenRanking, header: str) -> str:
    best = ranking.rows[0].seconds
    lines = [header, "imbalance = max / mean over ranks: attention stage, linear stage before"
                     " and after remapping",
             f"{'rank':>4}  {'balance':<17}{'step (s)':>9}{'x best':>8}{'attention':>11}"
             f"{'linear':>9}{'after':>8}{'remap (s)':>11}{'max ring':>10}"]
    for i, row in enumerate(ranking.rows, 1):
        ratio = row.imbalance
        lines.append(f"{i:>4}  {row.balance:<17}{row.seconds:>9.3f}{row.seconds / best:>8.2f}"
                     f"{ratio['attention']:>11.2f}{ratio['linear_before']:>9.2f}"
                     f"{ratio['linear_after']:>8.2f}{row.remap:>11.3f}{row.max_group:>10}")
    lines.append("predicted by the cost model (loom.sim.varlen_cost), forward + backward of the"
                 " step; gradient reduction and optimizer left out (equal for every balance)")
    return "\n".join(lines)


def to_json(ranking: VarlenRanking) -> str:
    return json.dumps({"steps": ranking.steps, "mean_sequences": ranking.mean_sequences,
                       "ranked": [{"balance": r.balance, "step_seconds": r.seconds,
                                   "attention_seconds": r.attention, "linear_seconds": r.linear,
                                   "remap_seconds": r.remap, "imbalance": r.imbalance,
                                   "largest_ring": r.max_group} for r in ranking.rows]},
                      indent=2)


def run(model: Any, name: str, cluster: Any, dist: LengthDistribution, tokens_per_step: int,
        framework: Any, as_json: bool) -> str:
    """The ranking of ``dist``'s steps for ``model`` on ``cluster``, as a table or JSON."""
    longest = int(dist.lengths.max())
    if tokens_per_step < longest:
        raise ConfigError("--global-batch-tokens", tokens_per_step,
                          f"must hold the distribution's longest sequence ({longest} tokens)")
    cost_model = CostModel(model, longest, 1, cluster, framework=framework)
    ranking = rank_balances(cost_model, cluster, dist, tokens_per_step, steps=STEPS)
    if as_json:
        return to_json(ranking)
    header = (f"variable-length steps of {name} on {cluster.describe()}: {STEPS} sampled steps"
              f" of {tokens_per_step} tokens (~{ranking.mean_sequences:.0f} sequences; median"
              f" {dist.median:g}, longest {longest}); {cluster.gpus} ranks as dp x cp")
    return table(ranking, header)


__all__ = ["run", "table", "to_json"]
