"""``engine.offload_states()`` / ``reload_states()``: a rank's training state moved off its device and back,
between steps, as stock ZeRO-1/2 does (e.g. RL frameworks free the actor's memory during generation).

The states are DeepSpeed's ``OffloadStateTypeEnum``: ``hp_params`` (the owned fp32 masters that are copies),
``lp_params`` (the model's tensors, with the masters that are views of them: an fp32 model's), ``lp_grads``
(owned gradients reduced and not yet stepped: stage 2 between micro-steps) and ``optim_states`` (the inner
optimizer's state, owned tensors only). ``contiguous_grad_buffer`` has no counterpart here (there is no
flat gradient buffer) and is accepted as already off the device. As stock, host copies are allocated pinned
(``pin_memory``), and after offloading the device is synchronized (unless ``non_blocking``) and the caching
allocator's freed blocks are given back (``empty_cache``), so that another user of the GPU gets them.

With ZeRO-Offload the masters and the optimizer state live in host memory already, where the host optimizer
steps them: DeepSpeed's engine leaves them out of ``engine.offload_states()`` from 0.19.0, as here. Asked to
offload them all the same (the optimizer's own method; an engine before 0.19.0, whose ``reload_states()`` would
then move them to the accelerator, where DeepSpeedCPUAdam cannot step them), it is refused, naming the states
that can be (``lp_params``, ``lp_grads``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.flat_parameters import FlatParameters
from ds_tensorshard.datapath.param_homes import ParameterHomes
from ds_tensorshard.datapath.update import OwnedShard
from ds_tensorshard.errors import TensorShardUsageError

HOST_RESIDENT = (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)  # with ZeRO-Offload


class OffloadMethods:
    """``engine.offload_states()`` / ``reload_states()`` of :class:`~ds_tensorshard.TensorShardOptimizer` (one of
    its bases), through its :class:`StateOffload`."""

    offload: StateOffload

    def offload_states(
        self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """``engine.offload_states()``: this rank's masters, model tensors, gradients and optimizer state off the
        device."""
        self.offload.offload(include, getattr(device, "value", device), pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """``engine.reload_states()``: every offloaded state back on the accelerator."""
        self.offload.reload(torch.device(get_accelerator().current_device_name()), non_blocking)


class StateOffload:
    """Which states are off the device, the moves that put them there and back, and where the parameters live
    meanwhile (:attr:`homes`, which a step points replaced ones back at)."""

    def __init__(
        self,
        shard: OwnedShard,
        params: Sequence[torch.nn.Parameter],
        buckets: Callable[[], Iterable[Bucket]],
        flat: FlatParameters | None = None,
    ) -> None:
        self.shard, self.params, self.buckets = shard, list(params), buckets  # every domain's, as they are now
        self.homes = ParameterHomes(self.params)  # where an update points them back: follows the moves here
        self.flat = flat  # flat parameters move as their one storage
        self.offloaded: set[OffloadStateTypeEnum] = set()

    def offload(
        self, include: Container[OffloadStateTypeEnum] | None, device: str, pin_memory: bool, non_blocking: bool
    ) -> None:
        """Move the states in ``include`` (all when None) that are still on the device to ``device`` (into
        page-locked host memory with ``pin_memory``, as stock), then free the device memory they held."""
        self._move_out(self._chosen(include), device, pin_memory, non_blocking)

    def _chosen(self, include: Container[OffloadStateTypeEnum] | None) -> list[OffloadStateTypeEnum]:
        """The states of ``include`` still on the device; those ZeRO-Offload keeps on the host are refused."""
        chosen = [s for s in OffloadStateTypeEnum if s not in self.offloaded and (include is None or s in include)]
        resident = [s.name for s in chosen if s in HOST_RESIDENT and self.shard.host is not None]
        if resident:
            raise TensorShardUsageError(
                f"engine.offload_states() of {resident} with ZeRO-Offload (zero_optimization.offload_optimizer): "
                "they live in host memory already, where the host optimizer steps them, and reload_states() "
                "would move them to the accelerator, where it cannot. Offload what is on the accelerator: "
                "engine.offload_states(include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads])"
            )
        return chosen

    def _move_out(
        self, chosen: Sequence[OffloadStateTypeEnum], device: str, pin_memory: bool, non_blocking: bool
    ) -> None:
        for state in chosen:
            self._move(state, lambda t: _moved(t, torch.device(device), pin_memory, non_blocking))
            self.offloaded.add(state)
        accelerator = get_accelerator()
        if not non_blocking:
            accelerator.synchronize()
        gc.collect()
        accelerator.empty_cache()

    def reload(self, device: torch.device, non_blocking: bool) -> None:
        """Move every offloaded state back to ``device``."""
        for state in list(self.offloaded):
            self._move(state, lambda t: t.to(device, non_blocking=non_blocking))
        self.offloaded.clear()
        if non_blocking:  # the host copies are released once the copies out of them are done
            get_accelerator().synchronize()

    @torch.no_grad()
    def _move(self, state: OffloadStateTypeEnum, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        shard = self.shard
        if state is OffloadStateTypeEnum.hp_params:
            for param, master in shard.masters.items():
                if param not in shard.views:
                    master.data = moved(master.data)
        elif state is OffloadStateTypeEnum.lp_params:
            self._move_model(moved)
            shard.relink_views()
        elif state is OffloadStateTypeEnum.lp_grads:
            shard.move_grads(moved)
        elif state is OffloadStateTypeEnum.optim_states:
            for values in shard.optimizer.state.values():
                for key, value in values.items():
                    if torch.is_tensor(value):
                        values[key] = moved(value)
        shard.forget_views()
        for bucket in self.buckets():
            bucket.forget_views()

    def _move_model(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The model's tensors (``lp_params``) to where ``moved`` puts them."""
        if self.flat is not None:
            self.flat.move(moved)
        for param in self.params:
            if self.flat is None or param not in self.flat:
                param.data = moved(param.data)
        self.homes.follow()


def _moved(tensor: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    if pin_memory and device.type == "cpu" and tensor.device.type != "cpu":
        return torch.empty_like(tensor, device=device, pin_memory=True).copy_(tensor, non_blocking=non_blocking)
    return tensor.to(device, non_blocking=non_blocking)
