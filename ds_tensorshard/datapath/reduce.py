"""Reduce: the mean of each tensor's gradient, summed over ranks onto its owner."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.errors import TensorShardUsageError
from ds_tensorshard.transports.deadline import wait_or_fail
from ds_tensorshard.transports.protocol import Pending, Transport

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


@dataclass(frozen=True)
class Averaging:
    """How a sum over ranks becomes DeepSpeed's mean gradient, in DeepSpeed's own order of operations.

    ``divide_before`` divides each rank's gradient before the sum (stock ZeRO-1/2's default
    reduce-scatter path, ``contiguous_gradients: false`` and ``prescale_gradients``);
    ``scale_before``/``scale_after`` multiply before the sum and on the owner after it (stock's
    post-scaling with ``reduce_scatter: false``, with ``gradient_predivide_factor``). Gradients travel
    in ``comm_dtype`` (``communication_data_type``; None: the parameters' own dtype) unless their bucket
    names its own (DeepSpeed's ``torch_autocast`` marks, which stock ZeRO-1/2 follows instead).
    """

    divide_before: float = 1.0
    scale_before: float = 1.0
    scale_after: float = 1.0
    comm_dtype: torch.dtype | None = None

    @classmethod
    def like_deepspeed(cls, engine: DeepSpeedEngine, world_size: int) -> Averaging:
        """``world_size``: the reducing group's (sequence x data parallel); the mean is over data-parallel
        ranks only, as stock divides by world / sequence_parallel_size (sequence shards add up)."""
        comm_dtype = engine._config.communication_data_type
        if not engine.gradient_average:
            return cls(comm_dtype=comm_dtype)
        data_parallel = world_size / float(engine.sequence_parallel_size)
        if engine.zero_optimization_partition_weights():  # stock ZeRO-3 divides before the sum, always
            return cls(divide_before=data_parallel, comm_dtype=comm_dtype)
        if engine.zero_reduce_scatter() or not engine.zero_contiguous_gradients() or not engine.postscale_gradients():
            return cls(divide_before=data_parallel, comm_dtype=comm_dtype)
        predivide = float(engine.gradient_predivide_factor())
        return cls(
            scale_before=1.0 / predivide,
            scale_after=1.0 if predivide == world_size else predivide / data_parallel,
            comm_dtype=comm_dtype,
        )


def autocast_comm_dtypes() -> Callable[[torch.nn.Parameter], torch.dtype | None]:
    """Each tensor's communication dtype as stock ZeRO-1/2 picks it once DeepSpeed's ``torch_autocast`` (0.17.2)
    has been set up in this process: the dtype DeepSpeed marked the tensor with (its autocast dtype, on Linear and
    Conv weights by default), else the tensor's own dtype, ``communication_data_type`` no longer counting; before
    that (or on older releases) None for every tensor: the config's ``communication_data_type``."""
    try:
        from deepspeed.runtime.torch_autocast import get_comm_dtype, is_autocast_initialized
    except ImportError:  # DeepSpeed before 0.17.2
        return lambda param: None
    return get_comm_dtype if is_autocast_initialized() else lambda param: None


IN_FLIGHT = 2  # buckets whose reduction may be under way at once: bounds the flat buffers alive


def start_reduce(
    bucket: Bucket,
    comm: Transport,
    averaging: Averaging,
    gradient_of: Callable[[torch.nn.Parameter], torch.Tensor | None],
    copy: bool = True,
) -> Pending:
    """Pack the bucket's gradients (missing ones count as zeros) and start their reduction onto the owners
    present (a stripe: one reduce-scatter, or one all-reduce where its routes say; a window: one operation where
    the transport groups them, else one reduce per owner).

    The result is this rank's segment of averaged gradients in the bucket's dtype (``copy``: a copy, so the
    flat buffer goes when the reduction is done; else, in the bucket's dtype already, a view of the flat buffer,
    for a caller that uses it at once), or None where this rank owns nothing in the bucket.
    """
    flat = bucket.pack(gradient_of, bucket.comm_dtype or averaging.comm_dtype, averaging.divide_before)
    if averaging.scale_before != 1.0:
        flat.mul_(averaging.scale_before)
    if bucket.by_all_reduce[0]:
        pending = comm.start_all_reduce(flat)
    elif bucket.slot:
        pending = comm.start_reduce_scatter(flat, bucket.slot)
    else:
        pending = comm.start_reduce_segments(flat, bucket.spans)
    mine = bucket.segment_of(comm.rank)

    def finish() -> torch.Tensor | None:
        pending.wait()
        if mine is None:
            return None
        segment = flat[mine.offset : mine.offset + mine.numel]
        if averaging.scale_after != 1.0:
            segment.mul_(averaging.scale_after)
        # back in the gradients' own dtype, where stock rounds a wider communication dtype's sums
        if segment.dtype != bucket.dtype:
            return segment.to(bucket.dtype)
        return segment.clone() if copy else segment

    return Pending(finish, flat, blocks_host=pending.blocks_host, parts=[pending])


class OverlappedReducer:
    """Starts each bucket's reduction from gradient hooks as soon as backward has produced all of its
    gradients, in bucket order (the same on every rank), with at most ``IN_FLIGHT`` buckets under way.

    ``deliver(bucket, segment)`` receives this rank's averaged segment of each bucket where it owns
    something; ``gradient_of(param)`` is what is packed, ``release(param)`` drops it once its last
    bucket is packed. A second backward at the same accumulation boundary (``boundary_of``: the engine's
    micro-step there) is refused: stock keeps only its gradients. The first backward that reduces records
    the order in which gradients became final; afterwards ``rebuild(order)`` (rank 0's order, the same on
    every rank) lays the buckets out in that order, so a tensor produced late never holds back buckets of
    gradients produced early.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        comm: Transport,
        averaging: Averaging,
        deliver: Callable[[Bucket, torch.Tensor], None],
        params: Sequence[torch.nn.Parameter],
        name_of: Callable[[torch.nn.Parameter], str],
        rebuild: Callable[[list[torch.nn.Parameter]], list[Bucket]],
        gradient_of: Callable[[torch.nn.Parameter], torch.Tensor | None] = lambda p: p.grad,
        release: Callable[[torch.nn.Parameter], None] = lambda p: setattr(p, "grad", None),
        step_of: Callable[[], int] = lambda: 0,
        boundary_of: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.comm, self.averaging, self.deliver, self.name_of, self.rebuild = comm, averaging, deliver, name_of, rebuild
        self.gradient_of, self.release, self.step_of = gradient_of, release, step_of
        # the engine's micro-step while at an accumulation boundary, else None; and that of the last reduction
        self.boundary_of = boundary_of
        self.reduced_at: int | None = None
        self.params = list(params)
        self.in_flight: deque[tuple[int, Bucket, Pending]] = deque()
        self.copy_segments = True  # False: ``deliver`` is done with a segment when it returns (no copy needed)
        self.observed: list[torch.nn.Parameter] | None = []  # None once the buckets follow backward's order
        self._use(buckets)

    def _use(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self.index: dict[int, list[int]] = {}
        releases: list[list[torch.nn.Parameter]] = [[] for _ in buckets]
        for i, bucket in enumerate(buckets):
            for param in bucket.params:
                self.index.setdefault(id(param), []).append(i)
        for param in self.params:
            if id(param) in self.index:
                releases[self.index[id(param)][-1]].append(param)
        self.releases = releases  # params whose gradient is no longer needed once bucket i is packed
        self.sizes = [len(b.params) for b in buckets]
        self._next_backward()

    def _next_backward(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.seen: set[int] = set()
        self.started = 0

    def gradient_ready(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is final for this backward: start every bucket that is now complete."""
        if not self.seen and self.reduced_at is not None and self.reduced_at == self.boundary_of():
            raise TensorShardUsageError(
                f"ds_tensorshard: a second backward before engine.step() (micro-step {self.reduced_at}): its "
                "gradients would be added to the first's on their owners, where stock ZeRO-1/2 keeps only the last "
                "backward's. Call engine.step() after every backward, or add the losses and run one backward"
            )
        if id(param) in self.seen:
            raise TensorShardUsageError(
                f"ds_tensorshard: the gradient of '{self.name_of(param)}' was delivered twice in one backward (a "
                "parameter reused under reentrant activation checkpointing, or a backward after one that raised "
                "before its end?); its bucket would be reduced with a partial gradient. Use non-reentrant "
                "checkpointing (use_reentrant=False), and do not go on training after a backward that raised"
            )
        self.seen.add(id(param))
        if self.observed is not None:
            self.observed.append(param)
        for i in self.index.get(id(param), ()):
            self.ready[i] += 1
            if self.ready[i] > self.sizes[i]:
                raise AssertionError(f"bucket {i} counted {self.ready[i]} ready gradients of {self.sizes[i]}")
        while self.started < len(self.buckets) and self.ready[self.started] == self.sizes[self.started]:
            self._start_next()

    def _start_next(self) -> None:
        """Start the next bucket; the oldest reductions (an earlier backward's first) complete to keep
        at most ``IN_FLIGHT`` under way, so every parameter's micro-step gradients arrive in order."""
        index = self.started
        bucket = self.buckets[index]
        self.started += 1
        pending = start_reduce(bucket, self.comm, self.averaging, self.gradient_of, self.copy_segments)
        self.in_flight.append((index, bucket, pending.describe_as(lambda: self.describe(index, bucket, "reduce"))))
        for param in self.releases[index]:
            self.release(param)
        while len(self.in_flight) > IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        index, bucket, pending = self.in_flight.popleft()
        segment = wait_or_fail(pending.wait, self.comm, lambda: self.describe(index, bucket, "reduce"))
        if segment is not None:
            self.deliver(bucket, segment)

    def finish(self, wait: bool = True) -> None:
        """After backward: start what hooks did not (buckets with unused parameters) and, if ``wait``,
        complete every reduction; else the last ones stay in flight until :meth:`drain`."""
        while self.started < len(self.buckets):
            self._start_next()
        if wait:
            self.drain()
        if self.observed is not None:
            self._follow_backward_order(self.observed)
        self._next_backward()
        self.reduced_at = self.boundary_of()

    def _follow_backward_order(self, observed: list[torch.nn.Parameter]) -> None:
        seen = {id(p) for p in observed}
        order = observed + [p for p in self.params if id(p) not in seen]  # never-ready ones last
        position = {id(p): i for i, p in enumerate(self.params)}
        agreed = torch.tensor([position[id(p)] for p in order], dtype=torch.int64, device=self.comm.device)
        where = lambda: f"step {self.step_of()}, agreeing on the order backward produces gradients in"  # noqa: E731
        wait_or_fail(self.comm.start_broadcast(agreed, 0).describe_as(where).wait, self.comm, where)
        self.observed = None
        self._use(self.rebuild([self.params[i] for i in agreed.tolist()]))

    def describe(self, index: int, bucket: Bucket, kind: str) -> str:
        """Where a collective of bucket ``index`` belongs, for an error."""
        first = bucket.segments[0].pieces[0].param
        return (
            f"step {self.step_of()}, {kind} of bucket {index} of {len(self.buckets)} (first tensor "
            f"'{self.name_of(first)}', {bucket.numel:,} elements)"
        )

    def drain(self) -> None:
        """Complete every reduction still in flight."""
        while self.in_flight:
            self._finish_oldest()
