"""Buckets: whole tensors of one dtype, laid out owner-major, moved by a single collective.

Tensors are taken in backward order (reverse registration order) and cut, per dtype, into buckets
of about ``bucket_numel`` elements (a larger tensor gets a bucket of its own). Inside a bucket the
tensors are grouped by owner: segment ``r`` holds the tensors rank ``r`` owns, so one
reduce-scatter leaves every owner its tensors' sums and one all-gather returns the updated
tensors. Where each segment starts in the flat buffer is the transport's choice (see
:mod:`.comm`); a bucket is packed into a flat buffer only while it is in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch


@dataclass(frozen=True)
class Bucket:
    """Segment ``r`` holds the tensors rank ``r`` owns, back to back."""

    dtype: torch.dtype
    device: torch.device
    segments: tuple[tuple[torch.nn.Parameter, ...], ...]

    @property
    def counts(self) -> tuple[int, ...]:
        """Elements in each rank's segment."""
        return tuple(sum(p.numel() for p in segment) for segment in self.segments)

    @property
    def numel(self) -> int:
        return sum(self.counts)

    def views(self, rank: int, segment: torch.Tensor) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(param, view shaped like param)`` for rank ``rank``'s tensors inside its flat ``segment``."""
        offset = 0
        for param in self.segments[rank]:
            yield param, segment[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()

    def pack(self, tensor_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]], starts: Sequence[int],
             total: int) -> torch.Tensor:
        """A flat buffer of ``total`` elements with segment ``r`` at ``starts[r]`` (zeros where nothing is)."""
        flat = torch.zeros(total, dtype=self.dtype, device=self.device)
        for rank, start in enumerate(starts):
            for param, view in self.views(rank, flat[start:start + self.counts[rank]]):
                source = tensor_of(param)
                if source is not None:
                    view.copy_(source)
        return flat

    def pack_segment(self, rank: int, tensor_of: Callable[[torch.nn.Parameter], torch.Tensor]) -> torch.Tensor:
        """Rank ``rank``'s segment alone, as a flat buffer."""
        flat = torch.empty(self.counts[rank], dtype=self.dtype, device=self.device)
        for param, view in self.views(rank, flat):
            view.copy_(tensor_of(param))
        return flat


def build_buckets(params: Sequence[torch.nn.Parameter], owner_of: Callable[[torch.nn.Parameter], int],
                  world_size: int, bucket_numel: int) -> list[Bucket]:
    """Cut ``params`` (given in registration order) into owner-major buckets, in backward order."""
    by_dtype: dict[torch.dtype, list[list[torch.nn.Parameter]]] = {}
    filled: dict[torch.dtype, int] = {}
    for param in reversed(params):
        runs = by_dtype.setdefault(param.dtype, [[]])
        if runs[-1] and filled[param.dtype] + param.numel() > bucket_numel:
            runs.append([])
            filled[param.dtype] = 0
        runs[-1].append(param)
        filled[param.dtype] = filled.get(param.dtype, 0) + param.numel()
    buckets = []
    for dtype, runs in by_dtype.items():
        for run in runs:
            segments = tuple(tuple(p for p in run if owner_of(p) == rank) for rank in range(world_size))
            buckets.append(Bucket(dtype=dtype, device=run[0].device, segments=segments))
    return buckets
