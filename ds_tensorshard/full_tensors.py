"""``deepspeed.utils``' per-parameter accessors on a ds_tensorshard engine: the whole fp32 master, gradient
and optimizer state of a tensor, assembled from its owners.

DeepSpeed's ``safe_get_full_fp32_param``, ``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their
``safe_set_full_*`` twins and ``safe_update_full_grad_vectorized`` reach a ZeRO-1/2 parameter through
``param._hp_mapping`` and methods its optimizer bound to the parameter (``get_full_hp_param``,
``set_full_hp_param``, ``get_full_hp_grad``, ``set_full_hp_grad``). :func:`attach` binds ours to every
trainable parameter. They behave as stock ZeRO-1/2's:

- A getter is a collective over the data-parallel group: every rank calls it and gets the whole tensor in
  fp32, shaped like the parameter. Each owner writes its block into a buffer of zeros and one all-reduce
  adds them up, which is exact (each element has one owner).
- A setter communicates nothing: every rank passes the whole value and each owner copies its block.
- The fp32 master exists from initialize; the optimizer state (the inner optimizer's per-element tensors:
  Adam's ``exp_avg``, ``exp_avg_sq``) from its first step. A master set from outside reaches the model's
  tensor at the next step, as stock's does (:meth:`~ds_tensorshard.datapath.update.OwnedShard.separate_master`).
- The gradient is the step's mean gradient, from the backward at the accumulation boundary until
  ``step()``: neither unscaled (fp16: times the loss scale) nor clipped. Before that boundary at stage 1,
  and outside the engine's hooks, ``safe_get_full_grad`` returns ``param.grad`` itself without coming here.

Stock fails on the ranks that hold a piece and leaves the others waiting in the all-reduce for a gradient
outside that window, an optimizer state before the first step and an unknown key; here every rank raises
:class:`~ds_tensorshard.errors.TensorAccessError` (two extra elements of the all-reduce carry the owners'
verdict), as it does for a value whose shape is not the tensor's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_tensorshard.datapath.shapes import numel_of, shape_of
from ds_tensorshard.errors import TensorAccessError, TensorShardUsageError
from ds_tensorshard.phase import Phase
from ds_tensorshard.transports.deadline import wait_or_fail

if TYPE_CHECKING:
    from ds_tensorshard.datapath.update import OwnedShard
    from ds_tensorshard.optimizer import TensorShardOptimizer

NO_STATE, NO_KEY = -2, -1  # a getter's verdict elements: owners with no optimizer state yet, without the key


def attach(optimizer: TensorShardOptimizer) -> None:
    """Give every trainable parameter of ``optimizer`` what DeepSpeed's accessors dispatch on."""
    owner = weakref.ref(optimizer)  # a model outliving its engine does not keep the optimizer state alive
    for index, param in enumerate(optimizer.params):
        access = FullTensor(owner, index)
        param._hp_mapping = access  # type: ignore[attr-defined]
        param.get_full_hp_param = access.get_full_hp_param  # type: ignore[attr-defined]
        param.set_full_hp_param = access.set_full_hp_param  # type: ignore[attr-defined]
        param.get_full_hp_grad = access.get_full_hp_grad  # type: ignore[attr-defined]
        param.set_full_hp_grad = access.set_full_hp_grad  # type: ignore[attr-defined]


def per_element_keys(optimizer: TensorShardOptimizer, master: torch.Tensor) -> list[str]:
    """The inner optimizer's state of ``master`` that is one value per element (as stock exposes)."""
    state = optimizer.optimizer.state.get(master, {})
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape]


def _no_engine() -> None:
    return None


class FullTensor:
    """The accessors of one parameter (``optimizer.params[index]``)."""

    def __init__(self, optimizer: Callable[[], TensorShardOptimizer | None], index: int) -> None:
        self._optimizer, self.index = optimizer, index

    def __getstate__(self) -> dict:  # a pickled parameter takes no engine along (a weak reference cannot be)
        return {"index": self.index}

    def __setstate__(self, state: dict) -> None:
        self._optimizer, self.index = _no_engine, state["index"]

    def _context(self) -> tuple[TensorShardOptimizer, torch.nn.Parameter, str]:
        optimizer = self._optimizer()
        if optimizer is None:
            raise TensorShardUsageError(
                "ds_tensorshard: the engine this parameter was sharded by is gone; its fp32 master, gradient and "
                "optimizer state went with it"
            )
        param = optimizer.params[self.index]
        return optimizer, param, optimizer.names[param]

    # -- fp32 master and optimizer state -----------------------------------------------------------
    @torch.no_grad()
    def get_full_hp_param(self, optim_state_key: str | None = None) -> torch.Tensor:
        """The whole fp32 master (or the optimizer state ``optim_state_key``), on every rank."""
        optimizer, param, name = self._context()
        flat = torch.zeros(numel_of(param) + 2, dtype=torch.float32, device=optimizer.comm.device)
        master = optimizer.shard.masters.get(param)
        if master is not None:
            block = optimizer.shard.blocks[param]
            if optim_state_key is None:
                flat[block.start : block.stop] = master.reshape(-1)
            elif not optimizer.optimizer.state.get(master):
                flat[NO_STATE] = 1.0
            elif optim_state_key not in per_element_keys(optimizer, master):
                flat[NO_KEY] = 1.0
            else:
                flat[block.start : block.stop] = optimizer.optimizer.state[master][optim_state_key].reshape(-1)
        what = "fp32 master" if optim_state_key is None else f"optimizer state {optim_state_key!r}"
        where = lambda: f"step {optimizer._step_of()}, safe_get_full of the {what} of '{name}'"  # noqa: E731
        comm = optimizer.domain_of[param].comm  # the group that owns its blocks
        wait_or_fail(lambda: comm.all_reduce_sum(flat, where), comm, where)
        if flat[NO_STATE] > 0:
            raise _no_state(optimizer, name, optim_state_key)
        if flat[NO_KEY] > 0:
            raise _unknown_key(optimizer, name, optim_state_key, master)
        return flat[:-2].view(shape_of(param))

    @torch.no_grad()
    def set_full_hp_param(self, value: torch.Tensor, optim_state_key: str | None = None) -> None:
        """Set this rank's block of the fp32 master (or of the optimizer state ``optim_state_key``)."""
        optimizer, param, name = self._context()
        what = "fp32 master" if optim_state_key is None else f"optimizer state {optim_state_key!r}"
        piece = _owned_piece(optimizer, param, name, value, what)
        shard = optimizer.shard
        if optim_state_key is None:
            if piece is not None:
                master = shard.separate_master(param)
                master.view(-1).copy_(piece)
            return
        if piece is None:  # a rank that owns no block of it checks the key against the group's others
            group = next(i for i, g in enumerate(optimizer.bit16_groups) if any(p is param for p in g))
            peers = [m for p, m in shard.masters.items() if shard.group_of[p] == group]
            known = {k for m in peers for k in per_element_keys(optimizer, m)}
            if known and optim_state_key not in known:
                raise _unknown_key(optimizer, name, optim_state_key, None, sorted(known))
            return
        master = shard.masters[param]
        if not optimizer.optimizer.state.get(master):
            raise _no_state(optimizer, name, optim_state_key)
        if optim_state_key not in per_element_keys(optimizer, master):
            raise _unknown_key(optimizer, name, optim_state_key, master)
        optimizer.optimizer.state[master][optim_state_key].view(-1).copy_(piece)

    # -- gradient --------------------------------------------------------------------------------
    @torch.no_grad()
    def get_full_hp_grad(self) -> torch.Tensor:
        """The step's whole mean gradient in fp32, on every rank (an owned tensor that got none: zeros)."""
        optimizer, param, name = self._context()
        shard = _gradient_window(optimizer, name, "safe_get_full_grad")
        flat = torch.zeros(numel_of(param), dtype=torch.float32, device=optimizer.comm.device)
        if param in shard.masters:
            block = shard.blocks[param]
            flat[block.start : block.stop] = shard.grads.view(param, step=_prepared(optimizer)).reshape(-1)
        where = lambda: f"step {optimizer._step_of()}, safe_get_full_grad of '{name}'"  # noqa: E731
        comm = optimizer.domain_of[param].comm  # the group that owns its blocks
        wait_or_fail(lambda: comm.all_reduce_sum(flat, where), comm, where)
        return flat.view(shape_of(param))

    @torch.no_grad()
    def set_full_hp_grad(self, value: torch.Tensor) -> None:
        """Set this rank's block of the step's mean gradient (what the norm, clipping and update then use)."""
        optimizer, param, name = self._context()
        shard = _gradient_window(optimizer, name, "safe_set_full_grad")
        piece = _owned_piece(optimizer, param, name, value, "gradient")
        if piece is None:
            return
        shard.grads.set(param, piece, step=_prepared(optimizer))  # prepared: the step's fp32 gradient


def _owned_piece(
    optimizer: TensorShardOptimizer, param: torch.nn.Parameter, name: str, value: torch.Tensor, key: str
) -> torch.Tensor | None:
    """This rank's block of ``value`` (flat), or None where it owns none; ``value`` must be shaped like ``param``."""
    if not torch.is_tensor(value) or tuple(value.shape) != shape_of(param):
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise TensorAccessError(
            f"ds_tensorshard: the {key} of '{name}' is set from a value of shape {shape}; the tensor's shape is "
            f"{shape_of(param)} (pass the whole tensor, the same on every rank)"
        )
    block = optimizer.shard.blocks.get(param)
    if block is None:
        return None
    return value.detach().to(optimizer.comm.device).reshape(-1)[block.start : block.stop]


def _prepared(optimizer: TensorShardOptimizer) -> bool:
    """Whether the step began (prepare_step ran): the gradient is then the step's fp32 one."""
    return optimizer.phase is Phase.PREPARED


def _gradient_window(optimizer: TensorShardOptimizer, name: str, call: str) -> OwnedShard:
    """The optimizer's shard once the step's gradients are on their owners and until step(); else the refusal."""
    if optimizer.phase not in (Phase.REDUCED, Phase.PREPARED):
        raise TensorAccessError(
            f"ds_tensorshard: {call} of '{name}': the gradient is available only after the backward at the "
            "gradient accumulation boundary and before engine.step() (as stock ZeRO-1/2; before that boundary "
            "at stage 1 it is param.grad, where backward produced one)"
        )
    optimizer.drain()  # reductions an initialize_many engine left in flight
    return optimizer.shard


def _no_state(optimizer: TensorShardOptimizer, name: str, key: str | None) -> TensorAccessError:
    return TensorAccessError(
        f"ds_tensorshard: tensor '{name}' has no optimizer state {key!r} yet: "
        f"{type(optimizer.optimizer).__name__} creates its state at its first step"
    )


def _unknown_key(
    optimizer: TensorShardOptimizer,
    name: str,
    key: str | None,
    master: torch.Tensor | None,
    known: list[str] | None = None,
) -> TensorAccessError:
    keys = known if known is not None else per_element_keys(optimizer, master) if master is not None else None
    kept = f"; it keeps {keys}" if keys else ""
    return TensorAccessError(
        f"ds_tensorshard: tensor '{name}' has no optimizer state {key!r}: "
        f"{type(optimizer.optimizer).__name__} keeps no such per-element state{kept}"
    )
