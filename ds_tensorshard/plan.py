"""Ownership plan: whole tensors split into one balanced set per rank (patent claim 5).

Every tensor is owned whole by exactly one rank. Tensors are placed largest first, each on the
rank with the fewest elements so far (ties: the lower rank); tensors of equal size are taken in
name order. The inputs are sorted before planning, so the plan depends only on the (name, numel)
pairs and the world size, never on dict or hash order: every rank computes the same plan.

Worked example, two ranks, tensors ``a``: 6, ``b``: 4, ``c``: 3, ``d``: 3 elements::

    a -> rank 0 (loads 6, 0)
    b -> rank 1 (loads 6, 4)
    c -> rank 1 (loads 6, 7)
    d -> rank 0 (loads 9, 7)

``numel_per_rank == (9, 7)``; the ideal is 8, so ``imbalance == 9 / 8``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence, Union

import torch


@dataclass(frozen=True)
class OwnershipPlan:
    """Which rank owns each tensor, and how many elements each rank owns."""

    world_size: int
    owners: Mapping[str, int]
    numels: Mapping[str, int]
    numel_per_rank: tuple[int, ...]
    param_names: Mapping[int, str] = field(default_factory=dict, repr=False, compare=False)

    def owner(self, tensor: Union[str, torch.Tensor]) -> int:
        """The owning rank of a tensor, given by name or as the parameter itself."""
        name = tensor if isinstance(tensor, str) else self.param_names.get(id(tensor))
        if name is None or name not in self.owners:
            raise KeyError(f"tensor {tensor if isinstance(tensor, str) else tuple(tensor.shape)} is not in this plan")
        return self.owners[name]

    def names_of(self, rank: int) -> list[str]:
        """Names of the tensors ``rank`` owns, in name order."""
        return sorted(name for name, r in self.owners.items() if r == rank)

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


def plan_ownership(tensors: Iterable[tuple[str, int]], world_size: int,
                   param_names: Mapping[int, str] | None = None) -> OwnershipPlan:
    """Split named tensors ``(name, numel)`` into ``world_size`` sets balanced by element count."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    items: Sequence[tuple[str, int]] = sorted(tensors, key=lambda t: (-t[1], t[0]))
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("tensor names in an ownership plan must be unique")
    heap = [(0, rank) for rank in range(world_size)]
    owners: dict[str, int] = {}
    loads = [0] * world_size
    for name, numel in items:
        load, rank = heapq.heappop(heap)
        owners[name] = rank
        loads[rank] = load + numel
        heapq.heappush(heap, (loads[rank], rank))
    return OwnershipPlan(world_size=world_size, owners=owners, numels=dict(items),
                         numel_per_rank=tuple(loads), param_names=dict(param_names or {}))
