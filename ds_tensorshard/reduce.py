"""Reduce: the mean of each tensor's gradient, summed over ranks onto its owner (claims 2 and 4)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .buckets import Bucket


@dataclass(frozen=True)
class Averaging:
    """How a sum over ranks becomes DeepSpeed's mean gradient, in DeepSpeed's own order of operations.

    ``divide_before`` divides each rank's gradient before the sum (stock ZeRO-2's reduce-scatter
    path and ``prescale_gradients``); ``scale_before``/``scale_after`` multiply before the sum and
    on the owner after it (stock's post-scaling, with ``gradient_predivide_factor``).
    """

    divide_before: float = 1.0
    scale_before: float = 1.0
    scale_after: float = 1.0

    @classmethod
    def like_deepspeed(cls, engine: Any, world_size: int) -> "Averaging":
        if not engine.gradient_average:
            return cls()
        stage2_scatter = engine.zero_optimization_stage() == 2 and engine.zero_reduce_scatter()
        if stage2_scatter or not engine.postscale_gradients():
            return cls(divide_before=float(world_size))
        predivide = float(engine.gradient_predivide_factor())
        return cls(scale_before=1.0 / predivide, scale_after=predivide / world_size)


def reduce_bucket(bucket: Bucket, comm: Any, averaging: Averaging) -> torch.Tensor:
    """One reduce-scatter for the whole bucket; returns this rank's segment of averaged gradients.

    Missing gradients (parameters unused this step) count as zeros.
    """
    starts, total = comm.layout(bucket.counts)
    flat = bucket.pack(lambda p: p.grad, starts, total)
    if averaging.divide_before != 1.0:
        flat.div_(averaging.divide_before)
    if averaging.scale_before != 1.0:
        flat.mul_(averaging.scale_before)
    mine = comm.reduce_scatter(flat, bucket.counts)
    if averaging.scale_after != 1.0:
        mine.mul_(averaging.scale_after)
    return mine
