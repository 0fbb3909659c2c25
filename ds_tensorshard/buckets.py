"""Buckets: groups of whole tensors with one owner and one dtype, moved by a single collective.

Tensors are taken in backward order (reverse registration order), grouped by owner and dtype,
and cut into buckets of at most ``bucket_numel`` elements (a larger tensor gets a bucket of its
own). A bucket is packed into one flat buffer only while it is in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class Bucket:
    """Tensors of one owner and one dtype, laid out back to back in a flat buffer."""

    owner: int
    dtype: torch.dtype
    params: tuple[torch.nn.Parameter, ...]
    offsets: tuple[int, ...]
    numel: int

    def slices(self, flat: torch.Tensor):
        """Yield ``(param, view of flat shaped like param)`` for each tensor in the bucket."""
        for param, offset in zip(self.params, self.offsets):
            yield param, flat[offset:offset + param.numel()].view(param.shape)

    def pack(self, tensor_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]],
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A new flat buffer holding ``tensor_of(param)`` for every param (zeros where it is None)."""
        flat = torch.empty(self.numel, dtype=dtype or self.dtype, device=self.params[0].device)
        for param, view in self.slices(flat):
            source = tensor_of(param)
            if source is None:
                view.zero_()
            else:
                view.copy_(source)
        return flat


def build_buckets(params: Sequence[torch.nn.Parameter], owner_of: Callable[[torch.nn.Parameter], int],
                  bucket_numel: int) -> list[Bucket]:
    """Cut ``params`` (given in registration order) into owner-major buckets in backward order."""
    groups: dict[tuple[int, torch.dtype], list[torch.nn.Parameter]] = {}
    for param in reversed(params):
        groups.setdefault((owner_of(param), param.dtype), []).append(param)
    buckets: list[Bucket] = []
    for (owner, dtype), members in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        current: list[torch.nn.Parameter] = []
        filled = 0
        for param in members:
            if current and filled + param.numel() > bucket_numel:
                buckets.append(_bucket(owner, dtype, current))
                current, filled = [], 0
            current.append(param)
            filled += param.numel()
        if current:
            buckets.append(_bucket(owner, dtype, current))
    return buckets


def _bucket(owner: int, dtype: torch.dtype, params: list[torch.nn.Parameter]) -> Bucket:
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    return Bucket(owner=owner, dtype=dtype, params=tuple(params), offsets=tuple(offsets), numel=total)
