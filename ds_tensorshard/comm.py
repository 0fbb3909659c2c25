"""Transports for the data path. ``TorchComm`` uses deepspeed.comm (gloo on CPU, NCCL on GPU).

A transport offers two collectives on one contiguous tensor, both rooted at an owner rank and
both non-blocking (they return a :class:`Pending`, so communication runs while the caller
computes): :meth:`~TorchComm.start_reduce` sums the tensor over the ranks into the owner's copy,
:meth:`~TorchComm.start_broadcast` copies the owner's tensor to every rank. The data path calls
them once per owner present in a bucket, so a segment of any size travels without padding.
Ranks are ranks within the data-parallel group. Every transport satisfies :class:`Transport`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed
from deepspeed import comm as dist

from .deadline import CollectiveTimeout


class Pending:
    """A collective in flight; :meth:`wait` completes it (once) and returns its result."""

    def __init__(self, finish: Callable[[], Any], *keep_alive: Any) -> None:
        self._finish, self._keep_alive, self._done, self._result = finish, keep_alive, False, None

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done, self._keep_alive = self._finish(), True, ()
        return self._result


class Transport(Protocol):
    """What the data path needs from a transport. Every wait gives up after ``timeout_s`` seconds with
    :class:`~ds_tensorshard.deadline.CollectiveTimeout`; :meth:`fail` then ends the job its own way."""

    rank: int
    world_size: int
    global_ranks: list[int]
    timeout_s: float
    name: str

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        """Start summing ``tensor`` over ranks into rank ``owner``'s ``tensor`` (others' are left undefined)."""

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        """Start copying rank ``owner``'s ``tensor`` into every rank's ``tensor``."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks, in place, on every rank."""

    def fail(self, message: str) -> NoReturn:
        """A collective missed its deadline: end this rank with ``message``."""


class TorchComm:
    """deepspeed.comm collectives over the data-parallel group."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.global_ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.timeout_s = timeout_s
        self.name = f"torch ({torch.distributed.get_backend(group)})"

    def _pending(self, work: Any, what: str, *keep_alive: Any) -> Pending:
        def finish() -> None:
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as err:
                if "timed out" not in str(err).lower():
                    raise
                raise CollectiveTimeout(what) from None

        return Pending(finish, *keep_alive)

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        work = dist.reduce(tensor, dst=self.global_ranks[owner], group=self.group, async_op=True)
        return self._pending(work, f"reduce to rank {owner}", tensor)

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        work = dist.broadcast(tensor, src=self.global_ranks[owner], group=self.group, async_op=True)
        return self._pending(work, f"broadcast from rank {owner}", tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._pending(dist.all_reduce(tensor, group=self.group, async_op=True), "all-reduce", tensor).wait()

    def fail(self, message: str) -> NoReturn:
        raise CollectiveTimeout(message)


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
