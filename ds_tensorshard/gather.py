"""Gather: updated parameters go from their owners back to every rank (claim 3)."""
from __future__ import annotations

from typing import Any

import torch

from .buckets import Bucket


@torch.no_grad()
def gather_bucket(bucket: Bucket, comm: Any) -> None:
    """One all-gather for the whole bucket: every rank receives every owner's updated tensors."""
    mine = bucket.pack_segment(comm.rank, lambda p: p.data)
    flat = comm.all_gather(mine, bucket.counts)
    starts, _ = comm.layout(bucket.counts)
    for rank, start in enumerate(starts):
        if rank != comm.rank:
            for param, view in bucket.views(rank, flat[start:start + bucket.counts[rank]]):
                param.data.copy_(view)
