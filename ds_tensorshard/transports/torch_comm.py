"""The torch transport: deepspeed.comm collectives (gloo on CPU, NCCL on GPU) over the data-parallel group.

A window's reduces (or broadcasts) are one collective per owner present; a stripe moves with one
``reduce_scatter_tensor`` and one ``all_gather_into_tensor``. gloo cannot group them (it reports
no coalescing support; its ``reduce_scatter`` is one all-reduce per rank, its ``all_gather`` takes equal
sizes only); NCCL could, in one coalescing-manager group, but that path waits for a run on GPUs.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed
from deepspeed import comm as dist

from ds_tensorshard.errors import CollectiveTimeout
from ds_tensorshard.transports.protocol import Pending, Span, all_of


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

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return all_of([self.start_reduce(flat[offset : offset + numel], owner) for owner, offset, numel in spans], flat)

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        pending = [self.start_broadcast(flat[offset : offset + numel], owner) for owner, offset, numel in spans]
        return all_of(pending, flat)

    def start_reduce_scatter(self, flat: torch.Tensor, slot: int) -> Pending:
        mine = flat[self.rank * slot : (self.rank + 1) * slot]
        out = torch.empty_like(mine)
        work = dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True)
        reduced = self._pending(work, f"reduce-scatter of {self.world_size} slots", flat, out)

        def finish() -> None:
            reduced.wait()
            mine.copy_(out)

        return Pending(finish, flat, out)

    def start_all_gather(self, flat: torch.Tensor, slot: int) -> Pending:
        mine = flat[self.rank * slot : (self.rank + 1) * slot].clone()
        work = dist.all_gather_into_tensor(flat, mine, group=self.group, async_op=True)
        return self._pending(work, f"all-gather of {self.world_size} slots", flat, mine)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._pending(dist.all_reduce(tensor, group=self.group, async_op=True), "all-reduce", tensor).wait()

    def fail(self, message: str) -> NoReturn:
        raise CollectiveTimeout(message)


def close_process_group() -> None:
    """End a script's torch.distributed world (and the plugin's MPI) in order while Python is fully alive:
    :func:`ds_tensorshard.transports.shutdown.close`, which the plugin also runs at exit."""
    from ds_tensorshard.transports import shutdown

    shutdown.close()
