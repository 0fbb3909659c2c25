"""Reduce: the mean of each tensor's gradient, summed over ranks onto its owner (claims 2 and 4)."""
from __future__ import annotations

from typing import Optional

import torch

from .buckets import Bucket
from .comm import TorchComm


def reduce_bucket(bucket: Bucket, comm: TorchComm, pre_scale: float, post_scale: float) -> Optional[torch.Tensor]:
    """One collective for the whole bucket; returns the averaged flat gradient on the owner, else None.

    Missing gradients (parameters unused this step) count as zeros. ``pre_scale`` and ``post_scale``
    implement DeepSpeed's averaging (``1 / world_size`` after the sum, unless
    ``gradient_predivide_factor`` moves part of it before).
    """
    flat = bucket.pack(lambda p: p.grad)
    if pre_scale != 1.0:
        flat.mul_(pre_scale)
    comm.reduce_sum(flat, bucket.owner)
    if comm.rank != bucket.owner:
        return None
    if post_scale != 1.0:
        flat.mul_(post_scale)
    return flat
