"""Transports for the data path. ``TorchComm`` uses deepspeed.comm (gloo on CPU, NCCL on GPU).

A transport decides where each rank's segment of a bucket sits in the flat buffer
(:meth:`layout`), sums a flat buffer over ranks leaving each rank its own segment
(:meth:`reduce_scatter`), and assembles everyone's segments (:meth:`all_gather`). Ranks are
ranks within the data-parallel group.
"""
from __future__ import annotations

from typing import Sequence

import torch
from deepspeed import comm as dist


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

    def reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Sum ``flat`` (laid out by :meth:`layout`) over ranks; return this rank's segment of the sum."""
        out = torch.empty(max(counts), dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out[:counts[self.rank]]

    def all_gather(self, segment: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Every rank's segment, in the flat layout of :meth:`layout`."""
        width = max(counts)
        padded = segment if segment.numel() == width else torch.cat([segment, segment.new_zeros(width - segment.numel())])
        flat = torch.empty(width * self.world_size, dtype=segment.dtype, device=segment.device)
        dist.all_gather_into_tensor(flat, padded, group=self.group)
        return flat

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)
