"""Reduce: the mean of each tensor's gradient, summed over ranks onto its owner (claims 2 and 4)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .buckets import Bucket
from .comm import Pending


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


IN_FLIGHT = 2  # buckets whose reduction may be under way at once: bounds the flat buffers alive


def start_reduce(bucket: Bucket, comm: Any, averaging: Averaging) -> Pending:
    """Pack the bucket's gradients (missing ones count as zeros), release them, and start one reduce-scatter.

    The result is this rank's segment of averaged gradients.
    """
    starts, total = comm.layout(bucket.counts)
    flat = bucket.pack(lambda p: p.grad, starts, total)
    for segment in bucket.segments:
        for param in segment:
            param.grad = None
    if averaging.divide_before != 1.0:
        flat.div_(averaging.divide_before)
    if averaging.scale_before != 1.0:
        flat.mul_(averaging.scale_before)
    pending = comm.start_reduce_scatter(flat, bucket.counts)

    def finish() -> torch.Tensor:
        mine = pending.wait()
        if averaging.scale_after != 1.0:
            mine.mul_(averaging.scale_after)
        return mine
    return Pending(finish)


class OverlappedReducer:
    """Starts each bucket's reduction from gradient hooks as soon as backward has produced all of its
    gradients, in bucket order (the same on every rank), with at most ``IN_FLIGHT`` buckets under way.

    ``deliver(bucket, segment)`` receives this rank's averaged segment of each bucket.
    """

    def __init__(self, buckets: list[Bucket], comm: Any, averaging: Averaging,
                 deliver: Callable[[Bucket, torch.Tensor], None]) -> None:
        self.buckets, self.comm, self.averaging, self.deliver = buckets, comm, averaging, deliver
        self.index = {id(p): i for i, b in enumerate(buckets) for segment in b.segments for p in segment}
        self.sizes = [sum(len(segment) for segment in b.segments) for b in buckets]
        self.in_flight: deque[tuple[Bucket, Pending]] = deque()
        self._next_backward()

    def _next_backward(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.started = 0

    def gradient_ready(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is final for this backward: start every bucket that is now complete."""
        self.ready[self.index[id(param)]] += 1
        while self.started < len(self.buckets) and self.ready[self.started] == self.sizes[self.started]:
            self._start_next()

    def _start_next(self) -> None:
        """Start the next bucket; the oldest reductions (an earlier backward's first) complete to keep
        at most ``IN_FLIGHT`` under way, so every parameter's micro-step gradients arrive in order."""
        bucket = self.buckets[self.started]
        self.started += 1
        self.in_flight.append((bucket, start_reduce(bucket, self.comm, self.averaging)))
        while len(self.in_flight) > IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        bucket, pending = self.in_flight.popleft()
        self.deliver(bucket, pending.wait())

    def finish(self, wait: bool = True) -> None:
        """After backward: start what hooks did not (buckets with unused parameters) and, if ``wait``,
        complete every reduction; else the last ones stay in flight until :meth:`drain`."""
        while self.started < len(self.buckets):
            self._start_next()
        if wait:
            self.drain()
        self._next_backward()

    def drain(self) -> None:
        """Complete every reduction still in flight."""
        while self.in_flight:
            self._finish_oldest()
