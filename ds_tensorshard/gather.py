"""Gather: updated parameters go from their owners back to every rank (claim 3)."""
from __future__ import annotations

from collections import deque
from typing import Any

import torch

from .buckets import Bucket
from .comm import Pending
from .reduce import IN_FLIGHT


@torch.no_grad()
def gather_buckets(buckets: list[Bucket], comm: Any) -> None:
    """One all-gather per bucket, at most ``IN_FLIGHT`` under way: every rank receives every owner's tensors."""
    in_flight: deque[tuple[Bucket, Pending]] = deque()
    for bucket in buckets:
        mine = bucket.pack_segment(comm.rank, lambda p: p.data)
        in_flight.append((bucket, comm.start_all_gather(mine, bucket.counts)))
        if len(in_flight) >= IN_FLIGHT:
            _unpack(*in_flight.popleft(), comm)
    while in_flight:
        _unpack(*in_flight.popleft(), comm)


def _unpack(bucket: Bucket, pending: Pending, comm: Any) -> None:
    flat = pending.wait()
    starts, _ = comm.layout(bucket.counts)
    for rank, start in enumerate(starts):
        if rank != comm.rank:
            for param, view in bucket.views(rank, flat[start:start + bucket.counts[rank]]):
                param.data.copy_(view)
