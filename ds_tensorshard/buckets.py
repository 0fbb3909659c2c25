"""Buckets: whole tensors of one dtype, laid out owner-major, moved by a single collective.

Per dtype, each rank's tensors are taken in backward order (reverse registration order), and each
bucket takes about ``bucket_numel / world_size`` elements from every rank's queue. Inside a bucket
the tensors are grouped by owner: segment ``r`` holds the tensors rank ``r`` owns, so one
reduce-scatter leaves every owner its tensors' sums and one all-gather returns the updated
tensors. Where each segment starts in the flat buffer is the transport's choice (see
:mod:`.comm`); a bucket is packed into a flat buffer only while it is in flight.
"""
from __future__ import annotations

from collections import deque
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
    """Cut ``params`` (given in registration order) into owner-major buckets with balanced segments.

    Per dtype, each rank's tensors form a queue in backward order; every bucket takes from the head
    of each queue as long as that brings the segment closer to ``bucket_numel / world_size`` elements
    (or to the largest head tensor, if larger), so segments are about equal (little padding for
    equal-size collectives) and every bucket holds gradients that backward produces at about the
    same time.
    """
    queues: dict[torch.dtype, list[deque]] = {}
    for param in reversed(params):
        queues.setdefault(param.dtype, [deque() for _ in range(world_size)])[owner_of(param)].append(param)
    buckets = []
    for dtype, per_rank in queues.items():
        while any(per_rank):
            target = max([bucket_numel // world_size] + [q[0].numel() for q in per_rank if q])
            segments = []
            for queue in per_rank:
                taken, filled = [], 0
                # take the next tensor while that brings the segment closer to the target size
                while queue and abs(filled + queue[0].numel() - target) < abs(filled - target):
                    filled += queue[0].numel()
                    taken.append(queue.popleft())
                segments.append(tuple(taken))
            device = next(p for segment in segments for p in segment).device
            buckets.append(Bucket(dtype=dtype, device=device, segments=tuple(segments)))
    return buckets
