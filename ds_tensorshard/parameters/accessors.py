"""``deepspeed.utils``' per-parameter accessors at stage 3: a ZeRO-3 parameter (one with ``ds_id``) is reached
through ``param._z3_optimizer``, which :func:`attach_stage3` sets on every parameter of the model.

The whole-tensor ones (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, ``safe_get_full_grad`` and
their ``safe_set_full_*`` twins) are those of stages 1/2 (:mod:`ds_tensorshard.full_tensors`: a getter is a
collective that assembles the tensor from its owners, a setter copies each owner's block), returning None for a
tensor the optimizer does not train, as stock's. The local ones (``safe_get_local_fp32_param``,
``safe_get_local_optimizer_state``, ``safe_get_local_grad`` and their setters) are this rank's part, as stock's
are its partition: here the block it owns (the whole tensor on its owner), empty on a rank that owns none of it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ds_tensorshard.errors import TensorAccessError, TensorShardUsageError
from ds_tensorshard.full_tensors import per_element_keys
from ds_tensorshard.parameters.zero_param import ZeroParam

if TYPE_CHECKING:
    from ds_tensorshard.optimizer import TensorShardOptimizer


def attach_stage3(optimizer: TensorShardOptimizer, module: torch.nn.Module) -> None:
    """Give every parameter of ``module`` what DeepSpeed's accessors dispatch on at stage 3."""
    access = Stage3Access(weakref.ref(optimizer))
    for param in module.parameters():
        param._z3_optimizer = access  # type: ignore[attr-defined]


class Stage3Access:
    """The methods DeepSpeed's ``safe_*`` functions call on ``param._z3_optimizer``."""

    def __init__(self, optimizer: weakref.ref) -> None:
        self._optimizer = optimizer

    def _trained(self, param: ZeroParam) -> bool:
        optimizer = self._optimizer()
        return optimizer is not None and param in optimizer.names

    def _live(self) -> TensorShardOptimizer:
        optimizer = self._optimizer()
        if optimizer is None:
            raise TensorShardUsageError("ds_tensorshard: the engine this parameter was sharded by is gone")
        return optimizer

    # -- whole tensors ------------------------------------------------------------------------------
    def get_full_hp_param(self, param: ZeroParam, optim_state_key: str | None = None) -> torch.Tensor | None:
        return param.get_full_hp_param(optim_state_key) if self._trained(param) else None

    def set_full_hp_param(self, value: torch.Tensor, param: ZeroParam, optim_state_key: str | None = None) -> None:
        if self._trained(param):
            param.set_full_hp_param(value, optim_state_key)

    def get_fp32_grad_for_param(self, param: ZeroParam) -> torch.Tensor | None:
        return param.get_full_hp_grad() if self._trained(param) else None

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: ZeroParam) -> None:
        if self._trained(param):
            param.set_full_hp_grad(value)

    def update_fp32_grad_for_param_vectorized(self, update_func: Any, param_list: list[ZeroParam]) -> None:
        """``safe_update_full_grad_vectorized``: each trained tensor's full gradient replaced by
        ``update_func(full, param)``, in the list's order on every rank (each read and write is collective)."""
        for param in param_list:
            if param.requires_grad and self._trained(param):
                param.set_full_hp_grad(update_func(param.get_full_hp_grad(), param))

    # -- this rank's part ---------------------------------------------------------------------------
    def get_local_fp32_param(self, param: ZeroParam, optim_state_key: str | None = None) -> torch.Tensor | None:
        return self._local(param, optim_state_key).clone() if self._trained(param) else None

    def set_local_hp_param(self, value: torch.Tensor, param: ZeroParam, optim_state_key: str | None = None) -> None:
        if self._trained(param):
            self._local(param, optim_state_key, value).copy_(value.reshape(-1))

    def get_local_fp32_grad_for_param(self, param: ZeroParam) -> torch.Tensor | None:
        return self._local_grad(param).float().clone() if self._trained(param) else None

    def set_local_grad_for_param(self, value: torch.Tensor, param: ZeroParam) -> None:
        if self._trained(param):
            self._local_grad(param, value).copy_(value.reshape(-1))

    def _local(self, param: ZeroParam, key: str | None, value: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's block of the fp32 master (or of the optimizer state ``key``), flat; empty where it owns none."""
        optimizer = self._live()
        master = optimizer.shard.masters.get(param)
        if master is None:
            local = torch.empty(0, dtype=torch.float32, device=optimizer.comm.device)
        elif key is None:
            local = (optimizer.shard.separate_master(param) if value is not None else master).view(-1)
        elif key not in per_element_keys(optimizer, master):
            raise TensorAccessError(
                f"ds_tensorshard: tensor '{optimizer.names[param]}' has no optimizer state {key!r} on this rank"
            )
        else:
            local = optimizer.optimizer.state[master][key].view(-1)
        return _matched(local, value, optimizer.names[param])

    def _local_grad(self, param: ZeroParam, value: torch.Tensor | None = None) -> torch.Tensor:
        optimizer = self._live()
        return _matched(owned_grad(optimizer, param), value, optimizer.names[param])


def owned_grad(optimizer: TensorShardOptimizer, param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's block of ``param``'s mean gradient, flat, a view of the reduced gradient the owner keeps (empty
    where it owns none)."""
    if param not in optimizer.shard.masters:
        return torch.empty(0, dtype=torch.float32, device=optimizer.comm.device)
    return optimizer.shard.grads.view(param).view(-1)


def _matched(local: torch.Tensor, value: torch.Tensor | None, name: str) -> torch.Tensor:
    if value is not None and value.numel() != local.numel():
        raise TensorAccessError(
            f"ds_tensorshard: the local part of '{name}' on this rank has {local.numel()} elements (the block it "
            f"owns), the value {value.numel()}"
        )
    return local
