"""ZeRO-Offload of the owned tensors: where each owner's fp32 masters, reduced gradients and optimizer state
live when the config sets ``zero_optimization.offload_optimizer`` device cpu, and the bytes that cross
between the accelerator and host memory.

Only whole owned tensors (or their dim-0 blocks) cross: each reduced gradient piece once, in the dtype it was
reduced in (it becomes fp32 on the host), and each updated tensor once, in the model's dtype (cast on the
host, as stock's bit16 staging buffer does). DeepSpeed's Muon matrices keep their gradients on the accelerator
instead (:mod:`~ds_tensorshard.datapath.muon_offload`): their momentum is lent there and stored back, and their
orthogonalized update and gradient's square (for the norm) cross to the host. On a CPU-only machine the
"host" is the same memory: the copies are still made, and counted, so that the figures are what a GPU would
move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

HOST = torch.device("cpu")


@dataclass
class HostTraffic:
    """Bytes copied between the accelerator and host memory (on CPU: that would be copied), by direction."""

    to_host: int = 0
    to_device: int = 0


@dataclass
class HostMemory:
    """Host placement of an owner's state: page-locked (``pin_memory``) where there is an accelerator to copy
    from, ordinary memory on a CPU-only machine, where pinning means nothing."""

    pin_memory: bool
    traffic: HostTraffic = field(default_factory=HostTraffic)

    def __post_init__(self) -> None:
        self.pinned = self.pin_memory and get_accelerator().device_name() != "cpu"

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory, allocated page-locked where pinned (not an ordinary tensor copied into pinned memory)."""
        return torch.empty(shape, dtype=dtype, device=HOST, pin_memory=self.pinned)

    def zeros(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def fetch(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host copy of an accelerator ``tensor`` (copied in its own dtype, then cast to ``dtype`` on the host)."""
        copy = self.empty(tensor.shape, tensor.dtype).copy_(tensor)
        self.traffic.to_host += tensor.numel() * tensor.element_size()
        return copy if dtype is None or dtype == copy.dtype else self.empty(tensor.shape, dtype).copy_(copy)

    def stage(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host copy of an accelerator ``tensor`` in flight: copied without blocking into pinned memory, and an
        event recorded after the copy (None on a CPU-only machine, where the copy is done when this returns),
        which the host synchronizes before it reads the copy."""
        copy = self.empty(tensor.shape, tensor.dtype).copy_(tensor, non_blocking=self.pinned)
        self.traffic.to_host += tensor.numel() * tensor.element_size()
        if not self.pinned:
            return copy, None
        event = get_accelerator().Event()
        event.record()
        return copy, event

    def store(self, tensor: torch.Tensor, target: torch.Tensor) -> None:
        """Copy an accelerator ``tensor`` into the host tensor ``target`` of the same shape and dtype."""
        target.copy_(tensor)
        self.traffic.to_host += tensor.numel() * tensor.element_size()

    def lend(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """An accelerator copy, on ``device``, of the host ``tensor`` (e.g. state to be updated there)."""
        self.traffic.to_device += tensor.numel() * tensor.element_size()
        return tensor.to(device, copy=True)

    def send(self, master: torch.Tensor, target: torch.Tensor) -> None:
        """Write a host ``master`` into an accelerator ``target`` of the same numel, cast to its dtype on the host."""
        target.copy_(master.reshape(target.shape).to(target.dtype))
        self.traffic.to_device += target.numel() * target.element_size()
