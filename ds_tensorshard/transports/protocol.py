"""What the data path needs from a transport (:class:`Transport`), and a collective in flight (:class:`Pending`).

A transport offers two collectives on one contiguous tensor, both rooted at an owner rank and
both non-blocking (they return a :class:`Pending`, so communication runs while the caller
computes): ``start_reduce`` sums the tensor over the ranks into the owner's copy,
``start_broadcast`` copies the owner's tensor to every rank. A bucket moves with their per-bucket
forms, ``start_reduce_segments`` and ``start_broadcast_segments``: one operation per bucket and
direction where the backend has one that pays (MPI's ``Ireduce_scatter`` with per-rank counts), else one
rooted collective per owner present; either way a segment of
any size travels without padding. A stripe (every rank's slot of equal size) moves with
``start_reduce_scatter`` and ``start_all_gather``. Ranks are ranks within the data-parallel group.
:class:`~ds_tensorshard.transports.torch_comm.TorchComm` and
:class:`~ds_tensorshard.transports.mpi_comm.MpiComm` satisfy :class:`Transport`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import torch


class Pending:
    """A collective in flight; :meth:`wait` completes it (once) and returns its result.

    Completion is in stream order: afterwards the work queued on the current stream sees the result. Where the
    collective runs on an accelerator (NCCL), that orders streams and the host goes on (``blocks_host`` False);
    a host transport (gloo on CPU, MPI) completes it by waiting on the host. ``where`` (set by the data path)
    names what the collective is for, for a deadline that passes while nobody waits on it.
    """

    def __init__(
        self, finish: Callable[[], Any], *keep_alive: Any, blocks_host: bool = True, parts: Sequence[Pending] = ()
    ) -> None:
        self._finish, self._keep_alive, self._done, self._result = finish, keep_alive, False, None
        self.blocks_host, self.parts = blocks_host, tuple(parts)
        self.where: Callable[[], str] | None = None

    def describe_as(self, where: Callable[[], str]) -> Pending:
        """Name what this collective (and each collective it completes) is for; returns itself."""
        self.where = where
        for part in self.parts:
            part.describe_as(where)
        return self

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done, self._keep_alive = self._finish(), True, ()
        return self._result


Span = tuple[int, int, int]
"""``(owner, offset, numel)``: the part of a bucket's flat buffer one rank owns. A bucket's spans are in
ascending owner order and back to back from offset 0, a rank owning nothing there having none."""


def all_of(pending: Sequence[Pending], *keep_alive: Any) -> Pending:
    """One :class:`Pending` completing several (blocking the host if any of them does)."""

    def finish() -> None:
        for p in pending:
            p.wait()

    return Pending(finish, *keep_alive, blocks_host=any(p.blocks_host for p in pending), parts=pending)


class Transport(Protocol):
    """What the data path needs from a transport. Every wait gives up after ``timeout_s`` seconds with
    :class:`~ds_tensorshard.errors.CollectiveTimeout`; :meth:`fail` then ends the job its own way."""

    rank: int
    world_size: int
    global_ranks: list[int]
    timeout_s: float
    name: str
    device: torch.device
    """Where the tensors of its collectives live: the engine's device (NCCL takes nothing else)."""
    broadcasts_by_owner: bool
    """Whether :meth:`start_broadcast_segments` is, to the other ranks, one :meth:`start_broadcast` of each span in
    order, so that an owner may send its span from a tensor of its own (the stage-3 gather does, where it can)."""

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        """Start summing ``tensor`` over ranks into rank ``owner``'s ``tensor`` (others' are left undefined)."""

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        """Start copying rank ``owner``'s ``tensor`` into every rank's ``tensor``."""

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        """Start summing each span of ``flat`` over ranks into its owner's ``flat`` (the rest left undefined)."""

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        """Start copying each span of its owner's ``flat`` into every rank's ``flat``."""

    def start_reduce_scatter(self, flat: torch.Tensor, slot: int) -> Pending:
        """Start summing ``flat`` (``world_size x slot`` elements) over ranks into this rank's slot of ``flat``,
        ``[rank x slot, (rank + 1) x slot)`` (the rest left undefined)."""

    def start_all_gather(self, flat: torch.Tensor, slot: int) -> Pending:
        """Start copying each rank's slot of its ``flat`` into that slot of every rank's ``flat``."""

    def start_all_reduce(self, flat: torch.Tensor) -> Pending:
        """Start summing ``flat`` over ranks into every rank's ``flat`` (a stripe reduced or gathered whole)."""

    def all_reduce_sum(self, tensor: torch.Tensor, where: Callable[[], str] | None = None) -> None:
        """Sum ``tensor`` over ranks, in place, on every rank (complete in stream order); ``where`` names what
        for (see :attr:`Pending.where`)."""

    def fail(self, message: str) -> NoReturn:
        """A collective missed its deadline: end this rank with ``message``."""
