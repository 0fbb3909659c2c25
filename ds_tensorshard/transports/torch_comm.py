"""The torch transport: torch.distributed collectives (gloo on CPU, NCCL on GPU) over the data-parallel group.

A window's reduces (or broadcasts) are one collective per owner present (deepspeed.comm); a stripe moves with one
reduce-scatter and one all-gather (torch's ``reduce_scatter_single`` / ``all_gather_single``, the
``*_tensor`` names before torch 2.13), or with all-reduces where its routes say. gloo cannot group them (it
reports no coalescing support; its ``reduce_scatter`` is one all-reduce per rank, its ``all_gather`` takes equal
sizes only).

On an accelerator a collective completes in stream order (``work.wait()``: the current stream waits for it,
the host goes on) and :class:`~ds_tensorshard.transports.watchdog.Watchdog` keeps its deadline; on the CPU
(gloo) the host waits, with the deadline as its timeout.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as tdist
from deepspeed import comm as dist

from ds_tensorshard.errors import CollectiveTimeout
from ds_tensorshard.transports.deadline import is_timeout
from ds_tensorshard.transports.protocol import Pending, Span, all_of
from ds_tensorshard.transports.watchdog import Watchdog

# torch 2.13 renamed the single-tensor collectives (the old names warn); looked up at each call
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(tdist, "reduce_scatter_single") else "reduce_scatter_tensor"
ALL_GATHER = "all_gather_single" if hasattr(tdist, "all_gather_single") else "all_gather_into_tensor"


class TorchComm:
    """torch.distributed collectives over the data-parallel group, on tensors on ``device``."""

    def __init__(self, group: Any, timeout_s: float, device: torch.device) -> None:
        self.group, self.device = group, torch.device(device)
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.global_ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.timeout_s = timeout_s
        self.name = f"torch ({tdist.get_backend(group)})"
        self.broadcasts_by_owner = True
        self.watchdog = None if self.device.type == "cpu" else Watchdog(self)

    def _pending(self, work: Any, what: str, *keep_alive: Any) -> Pending:
        if self.watchdog is None:
            return Pending(lambda: _completed(work, what, datetime.timedelta(seconds=self.timeout_s)), *keep_alive)
        pending = Pending(lambda: _completed(work, what), *keep_alive, blocks_host=False)
        self.watchdog.watch(work, pending, what)
        return pending

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        work = dist.reduce(tensor, dst=self.global_ranks[owner], group=self.group, async_op=True)
        return self._pending(work, f"reduce to rank {owner}", tensor)

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        work = dist.broadcast(tensor, src=self.global_ranks[owner], group=self.group, async_op=True)
        return self._pending(work, f"broadcast from rank {owner}", tensor)

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return all_of([self.start_reduce(flat[offset : offset + numel], owner) for owner, offset, numel in spans], flat)

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        pending = [self.start_broadcast(flat[offset : offset + numel], owner) for owner, offset, numel in spans]
        return all_of(pending, flat)

    def start_reduce_scatter(self, flat: torch.Tensor, slot: int) -> Pending:
        mine = flat[self.rank * slot : (self.rank + 1) * slot]
        out = torch.empty_like(mine)
        work = getattr(tdist, REDUCE_SCATTER)(out, flat, group=self.group, async_op=True)
        reduced = self._pending(work, f"reduce-scatter of {self.world_size} slots", flat, out)

        def finish() -> None:
            reduced.wait()
            mine.copy_(out)

        return Pending(finish, flat, out, blocks_host=reduced.blocks_host, parts=[reduced])

    def start_all_gather(self, flat: torch.Tensor, slot: int) -> Pending:
        mine = flat[self.rank * slot : (self.rank + 1) * slot]
        if flat.device.type == "cpu":  # gloo takes an input of its own; NCCL gathers in place (no slot-sized copy)
            mine = mine.clone()
        work = getattr(tdist, ALL_GATHER)(flat, mine, group=self.group, async_op=True)
        return self._pending(work, f"all-gather of {self.world_size} slots", flat, mine)

    def start_all_reduce(self, flat: torch.Tensor) -> Pending:
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        return self._pending(work, f"all-reduce of {flat.numel():,} elements", flat)

    def all_reduce_sum(self, tensor: torch.Tensor, where: Callable[[], str] | None = None) -> None:
        pending = self._pending(dist.all_reduce(tensor, group=self.group, async_op=True), "all-reduce", tensor)
        (pending if where is None else pending.describe_as(where)).wait()

    def fail(self, message: str) -> NoReturn:
        raise CollectiveTimeout(message)


def _completed(work: Any, what: str, timeout: datetime.timedelta | None = None) -> None:
    """``work`` complete: with ``timeout`` the host waits (at most that long), without it the current stream
    does. The backend's timeout errors become :class:`CollectiveTimeout` (``what``), to be diagnosed."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
    except RuntimeError as err:
        if not is_timeout(err):
            raise
        raise CollectiveTimeout(what) from None


def close_process_group() -> None:
    """End a script's torch.distributed world (and the plugin's MPI) in order while Python is fully alive:
    :func:`ds_tensorshard.transports.shutdown.close`, which the plugin also runs at exit."""
    from ds_tensorshard.transports import shutdown

    shutdown.close()
