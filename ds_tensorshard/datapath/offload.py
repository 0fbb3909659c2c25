"""``engine.offload_states()`` / ``reload_states()``: a rank's training state moved off its device and back,
between steps, as stock ZeRO-1/2 does (e.g. RL frameworks free the actor's memory during generation).

The states are DeepSpeed's ``OffloadStateTypeEnum``: ``hp_params`` (the owned fp32 masters that are copies),
``lp_params`` (the model's tensors, with the masters that are views of them: an fp32 model's), ``lp_grads``
(owned gradients reduced and not yet stepped: stage 2 between micro-steps) and ``optim_states`` (the inner
optimizer's state, owned tensors only). ``contiguous_grad_buffer`` has no counterpart here (there is no
flat gradient buffer) and is accepted as already off the device.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

import torch
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

from ds_tensorshard.datapath.update import OwnedShard


class StateOffload:
    """Which states are off the device, and the moves that put them there and back."""

    def __init__(self, shard: OwnedShard, params: Sequence[torch.nn.Parameter]) -> None:
        self.shard, self.params = shard, list(params)
        self.offloaded: set[OffloadStateTypeEnum] = set()

    def offload(
        self, include: Container[OffloadStateTypeEnum] | None, device: str, pin_memory: bool, non_blocking: bool
    ) -> None:
        """Move the states in ``include`` (all when None) that are still on the device to ``device`` (into
        page-locked host memory with ``pin_memory``, as stock)."""
        for state in OffloadStateTypeEnum:
            if state not in self.offloaded and (include is None or state in include):
                self._move(state, lambda t: _moved(t, torch.device(device), pin_memory, non_blocking))
                self.offloaded.add(state)

    def reload(self, device: torch.device, non_blocking: bool) -> None:
        """Move every offloaded state back to ``device``."""
        for state in list(self.offloaded):
            self._move(state, lambda t: t.to(device, non_blocking=non_blocking))
        self.offloaded.clear()

    @torch.no_grad()
    def _move(self, state: OffloadStateTypeEnum, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        shard = self.shard
        if state is OffloadStateTypeEnum.hp_params:
            for param, master in shard.masters.items():
                if param not in shard.views:
                    master.data = moved(master.data)
        elif state is OffloadStateTypeEnum.lp_params:
            for param in self.params:
                param.data = moved(param.data)
            shard.relink_views()
        elif state is OffloadStateTypeEnum.lp_grads:
            for param, grad in shard.accumulated.items():
                shard.accumulated[param] = moved(grad)
        elif state is OffloadStateTypeEnum.optim_states:
            for values in shard.optimizer.state.values():
                for key, value in values.items():
                    if torch.is_tensor(value):
                        values[key] = moved(value)


def _moved(tensor: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    if pin_memory and device.type == "cpu" and tensor.device.type != "cpu":
        return torch.empty_like(tensor, device=device, pin_memory=True).copy_(tensor, non_blocking=non_blocking)
    return tensor.to(device, non_blocking=non_blocking)
