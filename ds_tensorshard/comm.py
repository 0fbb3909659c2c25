"""Transports for the data path. ``TorchComm`` uses deepspeed.comm (gloo on CPU, NCCL on GPU).

A transport offers two collectives on one contiguous tensor, both rooted at an owner rank and
both non-blocking (they return a :class:`Pending`, so communication runs while the caller
computes): :meth:`~TorchComm.start_reduce` sums the tensor over the ranks into the owner's copy,
:meth:`~TorchComm.start_broadcast` copies the owner's tensor to every rank. The data path calls
them once per owner present in a bucket, so a segment of any size travels without padding.
Ranks are ranks within the data-parallel group. Every transport satisfies :class:`Transport`.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from deepspeed import comm as dist


class Pending:
    """A collective in flight; :meth:`wait` completes it (once) and returns its result."""

    def __init__(self, finish: Callable[[], Any], *keep_alive: Any) -> None:
        self._finish, self._keep_alive, self._done, self._result = finish, keep_alive, False, None

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done, self._keep_alive = self._finish(), True, ()
        return self._result


class Transport(Protocol):
    """What the data path needs from a transport."""

    rank: int
    world_size: int

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        """Start summing ``tensor`` over ranks into rank ``owner``'s ``tensor`` (others' are left undefined)."""

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        """Start copying rank ``owner``'s ``tensor`` into every rank's ``tensor``."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks, in place, on every rank."""


class TorchComm:
    """deepspeed.comm collectives over the data-parallel group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.global_ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        work = dist.reduce(tensor, dst=self.global_ranks[owner], group=self.group, async_op=True)
        return Pending(work.wait, tensor)

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        work = dist.broadcast(tensor, src=self.global_ranks[owner], group=self.group, async_op=True)
        return Pending(work.wait, tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


def close_process_group() -> None:
    """End a script's torch.distributed world while Python is fully alive: gloo work objects that are
    still referenced at interpreter exit can abort the process ("terminate called without an active
    exception"), so collect them, wait for every rank, then destroy the process group."""
    import gc

    import torch.distributed as tdist
    gc.collect()
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
