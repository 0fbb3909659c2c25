"""Gather: updated parameters go from their owners back to every rank (claim 3)."""
from __future__ import annotations

import torch

from .buckets import Bucket
from .comm import TorchComm


@torch.no_grad()
def broadcast_bucket(bucket: Bucket, comm: TorchComm) -> None:
    """Send the owner's parameters of ``bucket`` to every rank with one collective."""
    if comm.rank == bucket.owner:
        flat = bucket.pack(lambda p: p.data)
    else:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device)
    comm.broadcast(flat, bucket.owner)
    if comm.rank != bucket.owner:
        for param, view in bucket.slices(flat):
            param.data.copy_(view)
