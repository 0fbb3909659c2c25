"""Broadcast: updated parameters go from their owners back to every rank (with ZeRO-Offload, each bucket's tensors
updated on the host just before it is sent: :func:`update_while_broadcasting`)."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.flat_parameters import FlatGather
from ds_tensorshard.datapath.reduce import IN_FLIGHT
from ds_tensorshard.datapath.update import OwnedShard
from ds_tensorshard.transports.deadline import wait_or_fail
from ds_tensorshard.transports.protocol import Pending, Transport

if TYPE_CHECKING:
    from ds_tensorshard.datapath.domains import Domain


class Broadcast:
    """Every owner's segment of a bucket to every rank (a stripe: one all-gather, or where its routes say one
    all-reduce with every other slot -0.0, which adds nothing to any value, a zero's sign kept; a window: one
    broadcast per owner present), at most
    ``IN_FLIGHT`` buckets under way, the first ones started on creation; :meth:`finish` writes every owner's
    updated pieces into every rank's model. ``update(index, bucket)`` (ZeRO-Offload) updates this rank's tensors
    in a bucket just before the bucket is sent, so that later buckets are updated while earlier ones are broadcast."""

    def __init__(
        self,
        buckets: list[Bucket],
        comm: Transport,
        describe: Callable[[int, Bucket, str], str] = lambda i, b, kind: f"{kind} of bucket {i}",
        update: Callable[[int, Bucket], None] | None = None,
    ) -> None:
        self.todo, self.comm, self.describe, self.update = deque(enumerate(buckets)), comm, describe, update
        if comm.world_size == 1:  # the one rank owns every tensor, updated in place: nothing to send (but updates)
            for index, bucket in self.todo:
                if update is not None:
                    update(index, bucket)
            self.todo.clear()
        self.in_flight: deque[tuple[int, Bucket, torch.Tensor, Pending]] = deque()
        self._fill()

    def _fill(self) -> None:
        while self.todo and len(self.in_flight) < IN_FLIGHT:
            index, bucket = self.todo.popleft()
            if self.update is not None:
                self.update(index, bucket)  # index: the buckets sent before this one
            flat, pending = start_gather(bucket, self.comm)
            pending.describe_as(functools.partial(self.describe, index, bucket, "broadcast"))
            self.in_flight.append((index, bucket, flat, pending))

    @torch.no_grad()
    def finish(self) -> None:
        while self.in_flight:
            index, bucket, flat, pending = self.in_flight.popleft()
            wait_or_fail(pending.wait, self.comm, functools.partial(self.describe, index, bucket, "broadcast"))
            for segment in bucket.segments:
                if segment.owner != self.comm.rank:
                    received = flat[segment.offset : segment.offset + segment.numel]
                    torch._foreach_copy_(bucket.model_views(segment), list(received.split(segment.sizes)))
            self._fill()


def start_gather(bucket: Bucket, comm: Transport) -> tuple[torch.Tensor, Pending]:
    """The bucket's flat buffer with this rank's segment in place, and the collective bringing in the others'
    (one per owner or one for the bucket, never one per tensor)."""
    by_all_reduce = bucket.by_all_reduce[1]
    if by_all_reduce:
        flat = torch.full((bucket.numel,), -0.0, dtype=bucket.dtype, device=bucket.device)
    else:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
    mine = bucket.segment_of(comm.rank)
    if mine is not None:
        torch.cat(bucket.model_views(mine), out=flat[mine.offset : mine.offset + mine.numel])
    if by_all_reduce:
        return flat, comm.start_all_reduce(flat)
    if bucket.slot:
        return flat, comm.start_all_gather(flat, bucket.slot)
    return flat, comm.start_broadcast_segments(flat, bucket.spans)


def broadcast_buckets(
    buckets: list[Bucket],
    comm: Transport,
    describe: Callable[[int, Bucket, str], str] = lambda i, b, kind: f"{kind} of bucket {i}",
    update: Callable[[int, Bucket], None] | None = None,
) -> None:
    """Every rank receives every owner's updated tensors, two buckets in flight at a time (each bucket's
    ``update`` first, where given)."""
    Broadcast(buckets, comm, describe, update).finish()


def start_broadcast(domain: Domain, step: int) -> Broadcast | FlatGather:
    """A domain's broadcasts of its owners' updated tensors (flat parameters: one collective of their storage),
    started; ``finish()`` completes them."""
    if domain.flat is not None:
        return FlatGather(domain.flat, lambda: f"step {step}, gather of the flat parameters of {domain.name}")
    return Broadcast(domain.reducer.buckets, domain.comm, domain.reducer.describe)


def broadcast_domains(domains: dict[str, Domain], step: int) -> None:
    """Every domain's owners send their updated tensors to the other ranks of its group."""
    for domain in domains.values():
        start_broadcast(domain, step).finish()


def update_while_broadcasting(
    shard: OwnedShard, buckets: list[Bucket], comm: Transport, describe: Callable[[int, Bucket, str], str]
) -> tuple[int, int] | None:
    """ZeRO-Offload, after the norm: this rank's tensors in each bucket not yet updated are updated on the host
    just before the bucket is broadcast, while the buckets sent before it are still under way (their broadcast
    started); then any owned tensor in no bucket. Returns (buckets sent, buckets) at this rank's last update in a
    bucket, or None where it updated none there."""
    last: tuple[int, int] | None = None

    def update(sent: int, bucket: Bucket) -> None:
        nonlocal last
        todo = shard.not_updated_in(bucket, comm.rank)
        if todo:
            last = (sent, len(buckets))
        shard.update(todo)

    broadcast_buckets(buckets, comm, describe, update)
    shard.step()  # any owned tensor in no bucket
    return last
