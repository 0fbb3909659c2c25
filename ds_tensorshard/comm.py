"""Transports for the data path. ``TorchComm`` uses deepspeed.comm (gloo on CPU, NCCL on GPU).

A transport decides where each rank's segment of a bucket sits in the flat buffer
(:meth:`layout`), sums a flat buffer over ranks leaving each rank its own segment
(:meth:`start_reduce_scatter`), and assembles everyone's segments (:meth:`start_all_gather`);
both return a :class:`Pending` so that communication can run while the caller computes. Ranks
are ranks within the data-parallel group.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

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


class TorchComm:
    """deepspeed.comm collectives; segments are padded to the largest one (equal-size collectives)."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)

    def layout(self, counts: Sequence[int]) -> tuple[list[int], int]:
        """Start of each rank's segment, and the flat buffer's length."""
        width = max(counts)
        return [r * width for r in range(self.world_size)], width * self.world_size

    def start_reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int]) -> Pending:
        """Start summing ``flat`` (laid out by :meth:`layout`) over ranks; the result is this rank's segment."""
        out = torch.empty(max(counts), dtype=flat.dtype, device=flat.device)
        work = dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True)
        return Pending(lambda: (work.wait(), out[:counts[self.rank]])[1], flat)

    def start_all_gather(self, segment: torch.Tensor, counts: Sequence[int]) -> Pending:
        """Start gathering every rank's segment into the flat layout of :meth:`layout`."""
        width = max(counts)
        padded = segment if segment.numel() == width else torch.cat([segment, segment.new_zeros(width - segment.numel())])
        flat = torch.empty(width * self.world_size, dtype=segment.dtype, device=segment.device)
        work = dist.all_gather_into_tensor(flat, padded, group=self.group, async_op=True)
        return Pending(lambda: (work.wait(), flat)[1], padded)

    def reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return self.start_reduce_scatter(flat, counts).wait()

    def all_gather(self, segment: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return self.start_all_gather(segment, counts).wait()

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
