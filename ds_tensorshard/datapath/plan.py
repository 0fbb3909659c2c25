"""Ownership plan: tensors split into one balanced set per rank, each owned whole where it can be.

Tensors are placed largest first, each on the rank with the fewest elements so far (ties: the
lower rank; tensors of equal size in name order). The inputs are sorted before planning, so the
plan depends only on the (name, shape) pairs, the world size and the options, never on dict or
hash order: every rank computes the same plan.

``split="never"`` stops there: every tensor is owned whole by one rank. ``split="auto"`` (the
default) keeps that plan whenever its fullest rank holds at most :data:`TARGET_IMBALANCE` times
the ideal ``total / world_size``. Otherwise it plans again, placing each tensor whole on the
emptiest rank as long as that rank stays within :data:`TARGET_IMBALANCE` times the ideal; a tensor
that does not fit is cut into dim-0 blocks (whole rows), each owned whole by one rank, the first
filling the emptiest rank to :data:`FILL` times the ideal (to the nearest whole row), the next the
then emptiest, and so on, so only as many blocks as needed. Tensors named
in ``unsplittable`` (those of optimizers that need a whole matrix) are never cut. Tensors named in ``cut`` (at
ZeRO stage 3 on accelerators, where the cost model prices their gathers faster so) are cut first, one block of
whole rows on every rank (:func:`even_row_blocks`), and the others balanced around them.

Worked example, two ranks, tensors ``a``: 6, ``b``: 4, ``c``: 3, ``d``: 3 elements, ``split="never"``::

    a -> rank 0 (loads 6, 0)
    b -> rank 1 (loads 6, 4)
    c -> rank 1 (loads 6, 7)
    d -> rank 0 (loads 9, 7)

``numel_per_rank == (9, 7)``; the ideal is 8, so ``imbalance == 9 / 8``. With ``split="auto"``
(whole up to int(8 x 1.02) = 8 elements, blocks fill to 8 x 1.01 = 8.08) the 1-D tensor ``d``
does not fit whole on rank 0::

    a -> rank 0 (6, 0);  b -> rank 1 (6, 4);  c -> rank 1 (6, 7);
    d -> elements [0, 2) on rank 0 (8, 7), elements [2, 3) on rank 1 (8, 8)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

import torch

from ds_tensorshard.errors import PlanError

TARGET_IMBALANCE = 1.02  # split="auto" keeps the whole-tensor plan when it is at least this good
FILL = 1.01  # capacity per rank, over the ideal, when tensors are cut (headroom for whole rows)
SplitMode = Literal["auto", "never"]


@dataclass(frozen=True)
class Block:
    """Elements ``[start, stop)`` of a tensor's flattened storage (whole dim-0 rows; any elements in a flat plan,
    :mod:`~ds_tensorshard.datapath.flat_plan`), owned by ``rank``."""

    rank: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class OwnershipPlan:
    """Which rank owns each tensor (or each block of a split tensor), and how many elements each rank owns."""

    world_size: int
    blocks: Mapping[str, tuple[Block, ...]]
    """name -> its blocks in storage order: one block for a tensor owned whole."""
    numels: Mapping[str, int]
    numel_per_rank: tuple[int, ...]
    param_names: Mapping[int, str] = field(default_factory=dict, repr=False, compare=False)
    work_per_rank: tuple[float, ...] = ()
    """Compute cost per rank of the tensors given a ``work`` cost (empty when none was)."""
    flat_slot: int = 0
    """A flat plan's elements per rank of the flat storage (:mod:`~ds_tensorshard.datapath.flat_plan`); 0: none."""
    flat_offsets: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)
    """A flat plan's tensors: name -> where it starts in the flat storage."""

    def name_of(self, tensor: str | torch.Tensor) -> str:
        name = tensor if isinstance(tensor, str) else self.param_names.get(id(tensor))
        if name is None or name not in self.blocks:
            raise PlanError(f"tensor {tensor if isinstance(tensor, str) else tuple(tensor.shape)} is not in this plan")
        return name

    def owner(self, tensor: str | torch.Tensor) -> int:
        """The owning rank of a tensor owned whole, given by name or as the parameter itself."""
        name = self.name_of(tensor)
        blocks = self.blocks[name]
        if len(blocks) != 1:
            raise PlanError(
                f"tensor '{name}' is split into {len(blocks)} blocks owned by ranks "
                f"{[b.rank for b in blocks]}; see plan.blocks['{name}']"
            )
        return blocks[0].rank

    def blocks_of(self, tensor: str | torch.Tensor) -> tuple[Block, ...]:
        return self.blocks[self.name_of(tensor)]

    @property
    def owners(self) -> dict[str, int]:
        """name -> owning rank, for the tensors owned whole."""
        return {name: blocks[0].rank for name, blocks in self.blocks.items() if len(blocks) == 1}

    @property
    def split(self) -> dict[str, int]:
        """name -> number of blocks, for the tensors that were cut."""
        return {name: len(blocks) for name, blocks in self.blocks.items() if len(blocks) > 1}

    def names_of(self, rank: int) -> list[str]:
        """Names of the tensors ``rank`` owns whole or a block of, in name order."""
        return sorted(name for name, blocks in self.blocks.items() if any(b.rank == rank for b in blocks))

    @property
    def total_numel(self) -> int:
        return sum(self.numel_per_rank)

    @property
    def imbalance(self) -> float:
        """Fullest rank's element count divided by the ideal ``total / world_size`` (1.0 is perfect)."""
        ideal = self.total_numel / self.world_size
        return max(self.numel_per_rank) / ideal if ideal else 1.0

    @property
    def imbalance_bound(self) -> float:
        """The least imbalance any whole-tensor plan can reach: the largest tensor, or the ideal, whichever is more."""
        ideal = self.total_numel / self.world_size
        return max(max(self.numels.values(), default=0), ideal) / ideal if ideal else 1.0


TensorSpec = tuple[str, int | Sequence[int]]


def plan_ownership(
    tensors: Iterable[TensorSpec],
    world_size: int,
    param_names: Mapping[int, str] | None = None,
    split: SplitMode = "auto",
    unsplittable: AbstractSet[str] = frozenset(),
    work: Mapping[str, float] | None = None,
    loads: Sequence[int] | None = None,
    cut: AbstractSet[str] = frozenset(),
) -> OwnershipPlan:
    """Split named tensors ``(name, shape)`` into ``world_size`` sets balanced by element count.

    A bare int is the element count of a 1-D tensor. ``loads``: elements each rank holds already (another
    plan's), which the balance counts; ``numel_per_rank`` then includes them. ``cut``: tensors kept in one block
    of whole rows on every rank (:func:`even_row_blocks`), placed first (names not among ``tensors`` are ignored).
    """
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    if split not in ("auto", "never"):
        raise PlanError(f"split must be 'auto' or 'never', got {split!r}")
    shapes = {}
    for name, shape in tensors:
        if name in shapes:
            raise PlanError(f"tensor names in an ownership plan must be unique; '{name}' appears twice")
        shapes[name] = (shape,) if isinstance(shape, int) else tuple(shape)
    numels = {name: math.prod(shape) for name, shape in shapes.items()}
    work = dict(work or {})
    placed, start, work_loads = _by_work(work, numels, world_size)
    for name in sorted(cut & shapes.keys() - placed.keys()):
        placed[name] = even_row_blocks(shapes[name], world_size)
        start = [load + block.numel for load, block in zip(start, placed[name])]
    if loads is not None:
        if len(loads) != world_size:
            raise PlanError(f"loads has {len(loads)} entries for a world size of {world_size}")
        start = [a + b for a, b in zip(start, loads)]
    order = sorted((n for n in numels if n not in placed), key=lambda n: (-numels[n], n))
    blocks, per_rank = _largest_first(order, numels, start)
    ideal = (sum(numels.values()) + sum(loads or ())) / world_size
    if split == "auto" and ideal and max(per_rank) > TARGET_IMBALANCE * ideal:
        row_numel = {name: math.prod(shape[1:]) for name, shape in shapes.items()}
        blocks, per_rank = _fill_with_blocks(
            order, numels, row_numel, start, int(TARGET_IMBALANCE * ideal), FILL * ideal, unsplittable
        )
    return OwnershipPlan(
        world_size=world_size,
        blocks={**placed, **blocks},
        numels=numels,
        numel_per_rank=tuple(per_rank),
        param_names=dict(param_names or {}),
        work_per_rank=tuple(work_loads) if work else (),
    )


def even_row_blocks(shape: Sequence[int], world_size: int) -> tuple[Block, ...]:
    """A tensor of at least ``world_size`` rows in one block of whole rows on each rank, in rank order (rank r:
    rows ``[rows x r // n, rows x (r + 1) // n)``)."""
    rows = shape[0] if shape else 1
    row = math.prod(shape) // rows if rows else 0
    cuts = [rows * rank // world_size * row for rank in range(world_size + 1)]
    return tuple(Block(rank, cuts[rank], cuts[rank + 1]) for rank in range(world_size))


def _by_work(
    work: Mapping[str, float], numels: Mapping[str, int], world_size: int
) -> tuple[dict[str, tuple[Block, ...]], list[int], list[float]]:
    """Tensors with a compute cost, whole, largest cost first onto the rank with the least work; returns
    their blocks, the element counts and the work they leave on each rank."""
    heap = [(0.0, rank) for rank in range(world_size)]
    loads, work_loads = [0] * world_size, [0.0] * world_size
    blocks: dict[str, tuple[Block, ...]] = {}
    for name in sorted(work, key=lambda n: (-work[n], n)):
        cost, rank = heapq.heappop(heap)
        blocks[name] = (Block(rank, 0, numels[name]),)
        loads[rank] += numels[name]
        work_loads[rank] = cost + work[name]
        heapq.heappush(heap, (work_loads[rank], rank))
    return blocks, loads, work_loads


def _largest_first(
    order: Sequence[str], numels: Mapping[str, int], start: Sequence[int]
) -> tuple[dict[str, tuple[Block, ...]], list[int]]:
    """Whole tensors, largest first onto the emptiest rank, from per-rank loads ``start``."""
    loads = list(start)
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    blocks: dict[str, tuple[Block, ...]] = {}
    for name in order:
        load, rank = heapq.heappop(heap)
        blocks[name] = (Block(rank, 0, numels[name]),)
        loads[rank] = load + numels[name]
        heapq.heappush(heap, (loads[rank], rank))
    return blocks, loads


def _fill_with_blocks(
    order: Sequence[str],
    numels: Mapping[str, int],
    row_numel: Mapping[str, int],
    start: Sequence[int],
    limit: int,
    fill: float,
    unsplittable: AbstractSet[str],
) -> tuple[dict[str, tuple[Block, ...]], list[int]]:
    """Largest first onto the emptiest rank while it stays within ``limit``; a tensor that does not fit is
    cut into blocks of whole rows, each filling the then emptiest rank (one that holds no block of it yet)
    to ``fill`` (to the nearest row)."""
    world_size = len(start)
    loads = list(start)
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    blocks: dict[str, tuple[Block, ...]] = {}
    for name in order:
        numel, row = numels[name], max(row_numel[name], 1)
        load, rank = heapq.heappop(heap)
        if load + numel <= limit or name in unsplittable or numel <= row:
            blocks[name] = (Block(rank, 0, numel),)
            loads[rank] = load + numel
            heapq.heappush(heap, (loads[rank], rank))
            continue
        cut: list[Block] = []
        first, skipped = 0, []
        while first < numel:
            rows = max(
                math.floor((fill - load) / row + 0.5),  # to the nearest row: within half a row of fill,
                -(-(numel - first) // ((world_size - len(cut)) * row)),
                1,
            )  # but no rank left short
            last_rank = len(cut) == world_size - 1  # every other rank holds a block of it already
            stop = numel if last_rank else min(first + rows * row, numel)
            cut.append(Block(rank, first, stop))
            loads[rank] = load + stop - first
            skipped.append((loads[rank], rank))  # a rank holds at most one block of a tensor
            first = stop
            if first < numel:
                load, rank = heapq.heappop(heap)
        for entry in skipped:
            heapq.heappush(heap, entry)
        blocks[name] = tuple(cut)
    return blocks, loads
