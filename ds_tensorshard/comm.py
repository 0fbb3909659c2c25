"""The collectives the data path needs, over deepspeed.comm (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import torch
from deepspeed import comm as dist


class TorchComm:
    """Reduce, broadcast and all-reduce within one data-parallel process group.

    Ranks given to and returned by this class are ranks *within the group*.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]

    def reduce_sum(self, flat: torch.Tensor, owner: int) -> None:
        """Sum ``flat`` over the group into the owner's copy (others' copies are undefined after)."""
        dist.reduce(flat, dst=self._global[owner], group=self.group)

    def broadcast(self, flat: torch.Tensor, owner: int) -> None:
        """Overwrite every rank's ``flat`` with the owner's."""
        dist.broadcast(flat, src=self._global[owner], group=self.group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)
