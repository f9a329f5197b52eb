"""The named rank grid every parallelism is built from, and the torch DeviceMesh made from it.

Axes, outermost first (ranks are laid out row-major, so the last axis varies fastest and its groups
are the most local — tensor parallelism, the chattiest, stays inside a node):

=============  ==================================================================================
axis           what is split along it
=============  ==================================================================================
pp             pipeline stages (layers)
dp_replicate   the batch; parameters replicated (DDP, or the replicate half of HSDP)
dp_shard       the batch; parameters / gradients / optimizer state sharded (ZeRO, FSDP)
ep             the batch for dense layers; the experts of MoE layers
cp             the sequence (context parallelism: Ulysses, ring attention)
tp             attention heads and MLP columns/rows (tensor + sequence parallelism)
=============  ==================================================================================

``RankGrid`` is pure Python (no torch): rank <-> coordinates and the groups of ranks along any set
of axes, printable so anyone can see who talks to whom. ``build_mesh`` makes the torch
``DeviceMesh`` with the same axis names, plus the flattened ``dp`` mesh (dp_replicate x dp_shard x
ep) used for batch splitting and gradient reduction; it keeps the flattened mesh itself rather
than slicing it back out of the root (torch deprecates that). Nothing here is global: the grid and mesh are
values passed to whoever needs them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
DATA_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep")
# The data axes inside one dp_replicate replica (an outer dp_mode's replica trains on its own data)
INNER_DATA_AXES: tuple[str, ...] = ("dp_shard", "ep")


@dataclass(frozen=True)
class RankGrid:
    """A row-major grid of ranks over the named axes; axes not given have degree 1."""

    degrees: tuple[tuple[str, int], ...]

    def __init__(self, degrees: Mapping[str, int]) -> None:
        unknown = set(degrees) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; axes are {', '.join(AXES)}")
        for axis, degree in degrees.items():
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"degree of axis {axis!r} must be a positive integer, got {degree!r}")
        object.__setattr__(self, "degrees", tuple((a, int(degrees.get(a, 1))) for a in AXES))

    # -- shape ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d for _, d in self.degrees)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def degree(self, *axes: str) -> int:
        """Product of the degrees of ``axes`` (e.g. ``degree(*DATA_AXES)`` is the dp degree)."""
        self._check_axes(axes)
        lookup = dict(self.degrees)
        return math.prod(lookup[a] for a in axes)

    # -- rank <-> coordinates --------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a grid of {self.size} ranks")
        out: dict[str, int] = {}
        for axis, degree in reversed(self.degrees):
            rank, out[axis] = divmod(rank, degree)
        return {axis: out[axis] for axis in AXES}

    def rank(self, **coords: int) -> int:
        """The rank at the given coordinates (axes left out are at 0)."""
        self._check_axes(coords)
        rank = 0
        for axis, degree in self.degrees:
            index = coords.get(axis, 0)
            if not 0 <= index < degree:
                raise ValueError(f"coordinate {axis}={index} outside degree {degree}")
            rank = rank * degree + index
        return rank

    def index(self, rank: int, *axes: str) -> int:
        """Position of ``rank`` inside its group along ``axes`` (row-major over those axes)."""
        self._check_axes(axes)
        coords, lookup = self.coords(rank), dict(self.degrees)
        position = 0
        for axis in (a for a in AXES if a in axes):
            position = position * lookup[axis] + coords[axis]
        return position

    # -- groups -----------------------------------------------------------------------------------
    def group(self, rank: int, *axes: str) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except those along ``axes``."""
        self._check_axes(axes)
        fixed = self.coords(rank)
        varying = [a for a in AXES if a in axes]
        lookup = dict(self.degrees)
        members = []
        for values in itertools.product(*(range(lookup[a]) for a in varying)):
            members.append(self.rank(**{**fixed, **dict(zip(varying, values))}))
        return tuple(members)

    def groups(self, *axes: str) -> list[tuple[int, ...]]:
        """All groups along ``axes``, a partition of the ranks, ordered by their first rank."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.size):
            seen.setdefault(self.group(rank, *axes), None)
        return list(seen)

    def _check_axes(self, axes: Iterable[str]) -> None:
        bad = [a for a in axes if a not in AXES]
        if bad:
            raise ValueError(f"unknown axes {bad}; axes are {', '.join(AXES)}")

    # -- printing ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        active = [(a, d) for a, d in self.degrees if d > 1]
        header = " x ".join(f"{a}={d}" for a, d in active) or "single rank"
        lines = [f"RankGrid({header}; {self.size} ranks)"]
        names = [a for a, _ in active]
        if names:
            lines.append("rank  " + "  ".join(f"{n:>12}" for n in names))
            for rank in range(self.size):
                c = self.coords(rank)
                lines.append(f"{rank:>4}  " + "  ".join(f"{c[n]:>12}" for n in names))
            for axis in names:
                lines.append(f"{axis} groups: " + " ".join(str(list(g)) for g in self.groups(axis)))
        return "\n".join(lines)


@dataclass(frozen=True)
class Meshes:
    """The torch meshes of one job: ``root`` has the six named axes (degree-1 ones included, so
    code can always ask for ``root["tp"]``); ``dp`` is the flattened data axes (dp_replicate x
    dp_shard x ep), used for batch splitting and gradient reduction."""

    root: Any
    dp: Any
    dp_cp: Any  # dp x cp flattened (the gradient-averaging group under context parallelism)
    dp_no_ep: Any = None  # dp_replicate x dp_shard (expert weights are replicated only there)
    # ZeRO under context parallelism (dp_shard > 1, cp > 1): cp ranks hold the same weights, so
    # the shard group is dp_shard x cp flattened (TorchTitan's choice); ``shard_2d`` is HSDP's
    # (dp_replicate, dp_shard_cp) mesh when dp_replicate > 1. None otherwise.
    dp_shard_cp: Any = None
    shard_2d: Any = None
    # ZeRO with expert parallelism (dp_shard > 1, ep > 1): dense parameters are replicated over
    # ep (and cp) too, so they shard over dp_shard x ep (x cp) flattened; ``dense_2d`` is HSDP's
    # (dp_replicate, that) mesh when dp_replicate > 1. None otherwise.
    dp_shard_ep: Any = None
    dense_2d: Any = None
    # One replica's data ranks (dp_shard x ep x cp flattened) when dp_replicate > 1: where an
    # outer mode (parallel.dp_mode != sync) averages gradients and counts a step's tokens.
    replica: Any = None


def build_mesh(grid: RankGrid, device_type: str) -> Meshes:
    """The torch ``DeviceMesh``es of ``grid``; the default process group must span its ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(device_type, grid.shape, mesh_dim_names=AXES)
    dp = root[DATA_AXES]._flatten("dp")
    dp_cp = root[(*DATA_AXES, "cp")]._flatten("dp_cp") if grid.degree("cp") > 1 else dp
    dp_no_ep = None
    if grid.degree("ep") > 1 and grid.degree("dp_replicate", "dp_shard") > 1:
        dp_no_ep = root[("dp_replicate", "dp_shard")]._flatten("dp_no_ep")
    dp_shard_cp = shard_2d = None
    if grid.degree("cp") > 1 and grid.degree("dp_shard") > 1:
        dp_shard_cp = root[("dp_shard", "cp")]._flatten("dp_shard_cp")
        if grid.degree("dp_replicate") > 1:  # unflatten, not slice: torch deprecates slicing
            shard_2d = root[("dp_replicate", "dp_shard", "cp")]._flatten("dp_rep_shard_cp") \
                ._unflatten(0, (grid.degree("dp_replicate"), dp_shard_cp.size()),
                            ("dp_replicate", "dp_shard_cp"))
    dp_shard_ep = dense_2d = None
    if grid.degree("ep") > 1 and grid.degree("dp_shard") > 1:
        axes = ("dp_shard", "ep", "cp") if grid.degree("cp") > 1 else ("dp_shard", "ep")
        name = "_".join(axes)
        dp_shard_ep = root[axes]._flatten(name)
        if grid.degree("dp_replicate") > 1:
            dense_2d = root[("dp_replicate", *axes)]._flatten(f"dp_rep_{name}") \
                ._unflatten(0, (grid.degree("dp_replicate"), dp_shard_ep.size()),
                            ("dp_replicate", name))
    replica = None
    if grid.degree("dp_replicate") > 1:
        replica = root[(*INNER_DATA_AXES, "cp")]._flatten("replica")
    return Meshes(root=root, dp=dp, dp_cp=dp_cp, dp_no_ep=dp_no_ep, dp_shard_cp=dp_shard_cp,
                  shard_2d=shard_2d, dp_shard_ep=dp_shard_ep, dense_2d=dense_2d,
                  replica=replica)
