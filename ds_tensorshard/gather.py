"""Gather: updated parameters go from their owners back to every rank (claim 3)."""
from __future__ import annotations

from collections import deque
from typing import Any

import torch

from .buckets import Bucket
from .comm import Pending
from .reduce import IN_FLIGHT


class Gather:
    """One all-gather per bucket, at most ``IN_FLIGHT`` under way, the first ones started on creation;
    :meth:`finish` writes every owner's updated tensors into every rank's model."""

    def __init__(self, buckets: list[Bucket], comm: Any) -> None:
        self.todo, self.comm = deque(buckets), comm
        self.in_flight: deque[tuple[Bucket, Pending]] = deque()
        self._fill()

    def _fill(self) -> None:
        while self.todo and len(self.in_flight) < IN_FLIGHT:
            bucket = self.todo.popleft()
            mine = bucket.pack_segment(self.comm.rank, lambda p: p.data)
            self.in_flight.append((bucket, self.comm.start_all_gather(mine, bucket.counts)))

    @torch.no_grad()
    def finish(self) -> None:
        while self.in_flight:
            bucket, pending = self.in_flight.popleft()
            flat = pending.wait()
            starts, _ = self.comm.layout(bucket.counts)
            for rank, start in enumerate(starts):
                if rank != self.comm.rank:
                    for param, view in bucket.views(rank, flat[start:start + bucket.counts[rank]]):
                        param.data.copy_(view)
            self._fill()


def gather_buckets(buckets: list[Bucket], comm: Any) -> None:
    """Every rank receives every owner's updated tensors, two buckets in flight at a time."""
    Gather(buckets, comm).finish()
