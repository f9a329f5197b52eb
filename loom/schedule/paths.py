"""Microbatch paths through replicated pipeline stages (SkipPipe, issue 18): data, rules, generator.

In an ordinary pipeline every microbatch visits every stage, 0 to S-1, in order. SkipPipe
(Blagoev, Chen and Ersoy 2025, arXiv 2502.19913) gives each stage R replicas (one node each) and
each microbatch its own *path*: the stages it visits, in the order it visits them, and the
replica that runs each visit. A path may skip some stages and may swap the order of two.

The rules a path set obeys here are the paper's convergence constraints, as Loom states them:

* **The ends are fixed.** The first stage (the embedding) is always visited first and the last
  stage (the head and the loss, which Loom keeps on the last stage) always last; neither is ever
  skipped. Only the middle stages 1..S-2 can be skipped or swapped.
* **The skip ratio k is exact.** Every path skips exactly ``k*S`` stages, which must be a whole
  number no larger than S-3: every path visits at least one middle stage (skipping all S-2 of
  them on every path would leave them untrained).
* **Skips are balanced.** Every middle stage is skipped by the same number of microbatches (to
  within one when ``m*k*S`` does not divide evenly): each stage's weights see the same share of
  the batch, which is what the paper's per-stage microbatch limit enforces.
* **Consecutive skips are bounded**: a path never skips more than ``max_consecutive_skips``
  adjacent stages in a row (default 3: the reference implementation never jumps more than four
  stages ahead).
* **Swaps are rare and local**: at most ``max_swaps`` (0 or 1) swaps per path, each of two
  stages adjacent in the model (j and j+1, both visited and both in the middle), as the paper's
  reordering constraint allows.

``check_paths`` checks all of them and names the one broken; ``skip_count`` refuses a ratio that
cannot satisfy them before anything runs (``parallel.skip_ratio``). ``full_paths`` is the
ordinary pipeline; ``random_paths`` draws valid paths (the baseline the path scheduler,
``loom.schedule.path_search``, is compared with). Torch-free, floor 1; written here because no
library describes pipeline paths.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from loom.errors import ConfigError, loads_json

DEFAULT_MAX_CONSECUTIVE_SKIPS = 3
SKIPPIPE = "skippipe"  # parallel.schedule's name for path-scheduled pipelines


@dataclass(frozen=True, order=True)
class Visit:
    """One stop of a path: stage ``stage`` run by its replica ``replica``."""

    stage: int
    replica: int

    def __str__(self) -> str:
        return f"{self.stage}.{self.replica}"


@dataclass(frozen=True)
class Path:
    """The visits of one microbatch, in forward order (the backward runs them in reverse)."""

    visits: tuple[Visit, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "visits", tuple(self.visits))

    @classmethod
    def of(cls, stages: Iterable[int], replicas: Iterable[int]) -> Path:
        return cls(tuple(Visit(s, r) for s, r in zip(stages, replicas, strict=True)))

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(v.stage for v in self.visits)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(v.replica for v in self.visits)

    def __len__(self) -> int:
        return len(self.visits)

    def __str__(self) -> str:
        return " ".join(map(str, self.visits))


@dataclass(frozen=True)
class PathSet:
    """One path per microbatch over ``num_stages`` stages of ``num_replicas`` replicas each."""

    num_stages: int
    num_replicas: int
    paths: tuple[Path, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(self.paths))
        if self.num_stages < 1 or self.num_replicas < 1:
            raise ValueError(f"num_stages={self.num_stages} and num_replicas="
                             f"{self.num_replicas} must be >= 1")
        for m, path in enumerate(self.paths):
            for v in path.visits:
                if not (0 <= v.stage < self.num_stages and 0 <= v.replica < self.num_replicas):
                    raise ValueError(f"microbatch {m}: visit {v} outside {self.num_stages} "
                                     f"stages x {self.num_replicas} replicas")

    @property
    def num_microbatches(self) -> int:
        return len(self.paths)

    def visitors(self, stage: int, replica: int) -> tuple[int, ...]:
        """The microbatches whose paths visit ``stage`` on ``replica``, in increasing order."""
        return tuple(m for m, path in enumerate(self.paths) if Visit(stage, replica) in path.visits)

    def stage_visits(self) -> Counter:
        """stage -> how many microbatches visit it (on any replica)."""
        return Counter(s for path in self.paths for s in path.stages)

    def __str__(self) -> str:
        rows = "\n".join(f"  mb {m}: {path}" for m, path in enumerate(self.paths))
        return (f"PathSet: {self.num_stages} stages x {self.num_replicas} replicas, "
                f"{self.num_microbatches} microbatches (stage.replica)\n{rows}")

    def to_dict(self) -> dict:
        return {"num_stages": self.num_stages, "num_replicas": self.num_replicas,
                "paths": [[[v.stage, v.replica] for v in p.visits] for p in self.paths]}

    @classmethod
    def from_dict(cls, data: dict) -> PathSet:
        return cls(int(data["num_stages"]), int(data["num_replicas"]),
                   tuple(Path(tuple(Visit(int(s), int(r)) for s, r in p)) for p in data["paths"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PathSet:
        return cls.from_dict(loads_json(text))


@dataclass(frozen=True)
class PathRules:
    """The constraints of a path set (module docstring); ``skips`` stages skipped per path."""

    num_stages: int
    skips: int
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS
    max_swaps: int = 0

    @property
    def middle(self) -> tuple[int, ...]:
        return tuple(range(1, self.num_stages - 1))

    @property
    def path_length(self) -> int:
        return self.num_stages - self.skips


def _ratio_text(numerator: int, stages: int) -> str:
    return f"{float(Fraction(numerator, stages)):g}"


def skip_count(num_stages: int, skip_ratio: float, *,
               max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
               max_swaps: int = 0, field: str = "parallel.skip_ratio") -> PathRules:
    """The rules for ``skip_ratio`` on ``num_stages`` stages, or a ``ConfigError`` naming
    ``field`` and the constraint the ratio breaks (with the nearest valid ratios)."""
    if isinstance(skip_ratio, bool) or not isinstance(skip_ratio, (int, float)) \
            or not math.isfinite(skip_ratio) or not 0 <= skip_ratio < 1:
        raise ConfigError(field, skip_ratio, "must be a number in [0, 1)")
    if max_swaps not in (0, 1):
        raise ConfigError("parallel.max_swaps", max_swaps,
                          "must be 0 or 1: SkipPipe swaps at most one pair of stages per path")
    if max_consecutive_skips < 1:
        raise ConfigError("parallel.max_consecutive_skips", max_consecutive_skips, "must be >= 1")
    exact = skip_ratio * num_stages
    skips = round(exact)
    if abs(exact - skips) > 1e-9:
        most = max(num_stages - 3, 0)
        valid = [n for n in (math.floor(exact), math.ceil(exact)) if n <= most] or [most]
        raise ConfigError(field, skip_ratio,
                          f"skips {exact:g} of the {num_stages} stages per microbatch, which "
                          f"must be a whole number; nearest valid: "
                          + " or ".join(_ratio_text(n, num_stages) for n in valid))
    if skips and skips > num_stages - 2:
        raise ConfigError(field, skip_ratio,
                          f"skips {skips} of {num_stages} stages, but the first and last stage "
                          "are never skipped; at most "
                          f"{_ratio_text(max(num_stages - 3, 0), num_stages)}")
    if skips and skips == num_stages - 2:
        raise ConfigError(field, skip_ratio,
                          f"skips all {skips} middle stages of {num_stages}: balanced skipping "
                          f"would leave stages 1..{num_stages - 2} untrained; at most "
                          f"{_ratio_text(num_stages - 3, num_stages)}")
    visited_middle = num_stages - 2 - skips
    if skips > max_consecutive_skips * (visited_middle + 1):
        raise ConfigError(field, skip_ratio,
                          f"skips {skips} of the {num_stages - 2} middle stages, which cannot be"
                          f" done without skipping more than {max_consecutive_skips} consecutive"
                          " stages (max_consecutive_skips)")
    return PathRules(num_stages, skips, max_consecutive_skips, max_swaps)


def _longest_run(stages: Iterable[int]) -> int:
    longest = run = 0
    previous = None
    for s in sorted(stages):
        run = run + 1 if previous is not None and s == previous + 1 else 1
        longest, previous = max(longest, run), s
    return longest


def _swaps(order: Sequence[int]) -> list[int] | None:
    """Indices i where ``order`` swaps stages (order[i] = j+1, order[i+1] = j); None when the
    order is not the sorted one up to such disjoint adjacent swaps."""
    swaps, i = [], 0
    expected = sorted(order)
    while i < len(order):
        if order[i] == expected[i]:
            i += 1
        elif (i + 1 < len(order) and order[i] == expected[i + 1] and order[i + 1] == expected[i]
              and expected[i + 1] == expected[i] + 1):
            swaps.append(i)
            i += 2
        else:
            return None
    return swaps


def check_path(path: Path, rules: PathRules, num_replicas: int, where: str = "path") -> None:
    """Raise ``ValueError`` naming the rule ``path`` breaks (module docstring), if any."""
    stages = path.stages
    last = rules.num_stages - 1
    if any(not 0 <= r < num_replicas for r in path.replicas):
        raise ValueError(f"{where}: replica outside 0..{num_replicas - 1} in {path}")
    if len(set(stages)) != len(stages):
        raise ValueError(f"{where}: visits a stage twice ({path})")
    if not stages or stages[0] != 0:
        raise ValueError(f"{where}: must start at the first stage, 0 ({path})")
    if stages[-1] != last:
        raise ValueError(f"{where}: must end at the last stage, {last} ({path})")
    if len(stages) != rules.path_length:
        raise ValueError(f"{where}: visits {len(stages)} stages; skip ratio "
                         f"{rules.skips}/{rules.num_stages} means exactly {rules.path_length}")
    skipped = set(rules.middle) - set(stages)
    if _longest_run(skipped) > rules.max_consecutive_skips:
        raise ValueError(f"{where}: skips more than {rules.max_consecutive_skips} consecutive "
                         f"stages ({sorted(skipped)})")
    swaps = _swaps(stages[1:-1])
    if swaps is None:
        raise ValueError(f"{where}: reorders stages beyond swaps of adjacent stages ({path})")
    if len(swaps) > rules.max_swaps:
        raise ValueError(f"{where}: {len(swaps)} swaps; at most {rules.max_swaps} allowed")


def balance_bounds(rules: PathRules, num_microbatches: int) -> tuple[int, int]:
    """(fewest, most) microbatches that may visit each middle stage (skips balanced)."""
    middle = len(rules.middle)
    if not middle:
        return num_microbatches, num_microbatches
    visits = num_microbatches * (middle - rules.skips)
    return visits // middle, -(-visits // middle)


def check_paths(paths: PathSet, rules: PathRules) -> None:
    """Raise ``ValueError`` naming the first rule ``paths`` breaks (every path's, and balance)."""
    if paths.num_stages != rules.num_stages:
        raise ValueError(f"{paths.num_stages} stages, the rules are for {rules.num_stages}")
    for m, path in enumerate(paths.paths):
        check_path(path, rules, paths.num_replicas, where=f"microbatch {m}")
    low, high = balance_bounds(rules, paths.num_microbatches)
    counts = paths.stage_visits()
    for stage in rules.middle:
        if not low <= counts[stage] <= high:
            raise ValueError(f"stage {stage} is visited by {counts[stage]} microbatches; balanced"
                             f" skipping needs {low}..{high}")


def stage_orders(rules: PathRules) -> list[tuple[int, ...]]:
    """Every stage order one path may take under ``rules`` (all skip sets, and the allowed swaps),
    in a fixed order: unswapped first."""
    last = rules.num_stages - 1
    orders: list[tuple[int, ...]] = []
    if rules.num_stages == 1:
        return [(0,)]
    for kept in itertools.combinations(rules.middle, len(rules.middle) - rules.skips):
        skipped = set(rules.middle) - set(kept)
        if _longest_run(skipped) > rules.max_consecutive_skips:
            continue
        orders.append((0, *kept, last))
    if rules.max_swaps:
        swapped = []
        for order in orders:
            for i in range(1, len(order) - 2):
                if order[i + 1] == order[i] + 1:
                    swapped.append(order[:i] + (order[i + 1], order[i]) + order[i + 2:])
        orders += swapped
    return orders


def full_paths(num_stages: int, num_microbatches: int, num_replicas: int = 1) -> PathSet:
    """The ordinary pipeline: microbatch m visits every stage in order, all on replica m % R."""
    return PathSet(num_stages, num_replicas, tuple(
        Path.of(range(num_stages), [m % num_replicas] * num_stages)
        for m in range(num_microbatches)))


def first_replica(microbatch: int, num_replicas: int) -> int:
    """The replica of the first stage that feeds ``microbatch`` (each loads an equal share)."""
    return microbatch % num_replicas


def random_paths(rules: PathRules, num_replicas: int, num_microbatches: int, *,
                 seed: int = 0, swap_probability: float = 0.5, tries: int = 200) -> PathSet:
    """Valid paths drawn at random: balanced skip sets (each microbatch skips the middle stages
    skipped least so far, ties drawn), a swap with ``swap_probability`` where allowed, and a
    random replica for every visit after the first (``first_replica``). With no skips and one
    replica this is ``full_paths``."""
    rng = random.Random(seed)
    low, high = balance_bounds(rules, num_microbatches)
    plain = [o for o in stage_orders(PathRules(rules.num_stages, rules.skips,
                                               rules.max_consecutive_skips, 0))]
    for _ in range(tries):
        counts: Counter = Counter()
        chosen: list[tuple[int, ...]] = []
        for m in range(num_microbatches):
            left = num_microbatches - m - 1
            feasible = [o for o in plain if _fits(o, counts, rules, low, high, left)]
            if not feasible:
                break
            best = min(sum(counts[s] for s in o[1:-1]) for o in feasible)
            order = rng.choice([o for o in feasible if sum(counts[s] for s in o[1:-1]) == best])
            counts.update(order[1:-1])
            chosen.append(order)
        else:
            break
    else:
        raise ValueError(f"no balanced skip sets found for {num_microbatches} microbatches "
                         f"under {rules}")
    paths = []
    for m, order in enumerate(chosen):
        if rules.max_swaps and rng.random() < swap_probability:
            spots = [i for i in range(1, len(order) - 2) if order[i + 1] == order[i] + 1]
            if spots:
                i = rng.choice(spots)
                order = order[:i] + (order[i + 1], order[i]) + order[i + 2:]
        replicas = [first_replica(m, num_replicas)] + [rng.randrange(num_replicas)
                                                       for _ in order[1:]]
        paths.append(Path.of(order, replicas))
    result = PathSet(rules.num_stages, num_replicas, tuple(paths))
    check_paths(result, rules)
    return result


def _fits(order: Sequence[int], counts: Counter, rules: PathRules, low: int, high: int,
          left: int) -> bool:
    """Whether visiting ``order`` keeps every middle stage within ``high`` and still able to
    reach ``low`` with ``left`` microbatches to come."""
    kept = set(order[1:-1])
    for stage in rules.middle:
        after = counts[stage] + (stage in kept)
        if after > high or after + left < low:
            return False
    return True


__all__ = ["DEFAULT_MAX_CONSECUTIVE_SKIPS", "SKIPPIPE", "Path", "PathRules", "PathSet", "Visit",
           "balance_bounds", "check_path", "check_paths", "first_replica", "full_paths",
           "random_paths", "skip_count", "stage_orders"]
