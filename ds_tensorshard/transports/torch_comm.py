"""The torch transport: deepspeed.comm collectives (gloo on CPU, NCCL on GPU) over the data-parallel group.

A bucket's reduces (or broadcasts), one per owner present, go out as one launch where the backend
groups collectives (NCCL: torch's coalescing manager, one ``ncclGroupStart``/``ncclGroupEnd``, the way
torch itself moves an uneven reduce-scatter or all-gather there); gloo groups nothing (its
``reduce_scatter`` is one all-reduce per rank, its ``all_gather`` takes equal sizes only), so there they
stay one collective each.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed
from deepspeed import comm as dist
from torch.distributed.distributed_c10d import _coalescing_manager, _get_default_group

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
        self._groups: dict[str, bool] = {}  # device type -> whether its backend groups collectives

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

    def groups(self, device: torch.device) -> bool:
        """Whether the backend on ``device`` runs several collectives as one launch."""
        if device.type not in self._groups:
            group = self.group if self.group is not None else _get_default_group()
            self._groups[device.type] = bool(group._get_backend(device).supports_coalescing)
        return self._groups[device.type]

    def _segments(
        self, flat: torch.Tensor, spans: Sequence[Span], start: Callable[[torch.Tensor, int], Pending], kind: str
    ) -> Pending:
        if len(spans) < 2 or not self.groups(flat.device):
            return all_of([start(flat[offset : offset + numel], owner) for owner, offset, numel in spans], flat)
        call = torch.distributed.reduce if kind == "reduce" else torch.distributed.broadcast
        group = self.group if self.group is not None else _get_default_group()
        with _coalescing_manager(group, flat.device, async_ops=True) as grouped:
            for owner, offset, numel in spans:
                call(flat[offset : offset + numel], self.global_ranks[owner], group=group, async_op=True)
        owners = [owner for owner, _, _ in spans]
        return all_of([self._pending(work, f"grouped {kind} of ranks {owners}") for work in grouped.works], flat)

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return self._segments(flat, spans, self.start_reduce, "reduce")

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return self._segments(flat, spans, self.start_broadcast, "broadcast")

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
