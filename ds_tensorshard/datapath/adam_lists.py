"""DeepSpeed's FusedAdam over a rank's owned masters, its tensor lists made once.

``FusedAdam.step`` builds its kernel's lists tensor by tensor at every call (``p.data``, ``p.grad.data``: three
operators dispatched per tensor): for thousands of small owned tensors that is more host work than the update.
Here the masters, their gradients (views fixed at start-up, :mod:`~ds_tensorshard.datapath.gradients`) and
their Adam moments are listed once per param group, again only when one of them is replaced, and FusedAdam's
own kernel is called through DeepSpeed's ``multi_tensor_applier`` with the arguments ``FusedAdam.step`` gives
it: the group's hyper-parameters as they are at the call (a scheduler changes ``lr``), and the step count of the
group's last tensor plus one, which FusedAdam then keeps there. The moments are made as FusedAdam makes them,
at a tensor's first step. So the update is FusedAdam's, bit for bit.
"""

from __future__ import annotations

import torch
from deepspeed.ops.adam.fused_adam import FusedAdam, multi_tensor_applier


class AdamLists:
    """Steps a :class:`FusedAdam` whose tensors are fp32 masters that all have a gradient."""

    def __init__(self, optimizer: FusedAdam) -> None:
        self.optimizer = optimizer
        self._lists: dict[int, tuple[tuple[int, ...], list[list[torch.Tensor]]]] = {}

    @staticmethod
    def applies(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is DeepSpeed's FusedAdam itself (not a subclass, whose step may differ)."""
        return type(optimizer) is FusedAdam

    def forget(self) -> None:
        """Drop the lists (their tensors moved): made again at the next step."""
        self._lists.clear()

    def _lists_of(self, index: int, group: dict) -> list[list[torch.Tensor]]:
        """The group's lists (gradients, masters, first and second moments), made again when any of them is
        another tensor than when they were made (a master replaced, a state loaded)."""
        params: list[torch.Tensor] = group["params"]
        state = self.optimizer.state
        tensors = [(p, p.grad, state[p].get("exp_avg"), state[p].get("exp_avg_sq")) for p in params]
        identity = tuple(id(t) for four in tensors for t in four)
        cached = self._lists.get(index)
        if cached is None or cached[0] != identity:
            for param in params:
                assert param.dtype == torch.float32 and param.grad is not None, "masters are fp32, with a gradient"
                if not state[param]:  # as FusedAdam makes them at a tensor's first step
                    state[param]["step"] = group.get("step", 0)
                    state[param]["exp_avg"] = torch.zeros_like(param)
                    state[param]["exp_avg_sq"] = torch.zeros_like(param)
            moments = [[state[p][name] for p in params] for name in ("exp_avg", "exp_avg_sq")]
            tensors = [(p, p.grad, state[p]["exp_avg"], state[p]["exp_avg_sq"]) for p in params]
            identity = tuple(id(t) for four in tensors for t in four)
            grads: list[torch.Tensor] = [p.grad for p in params if p.grad is not None]
            cached = self._lists[index] = (identity, [grads, list(params), *moments])
        return cached[1]

    @torch.no_grad()
    def step(self) -> None:
        optimizer = self.optimizer
        for index, group in enumerate(optimizer.param_groups):
            if not group["params"]:
                continue
            group.setdefault("step", 0)
            lists = self._lists_of(index, group)
            last = optimizer.state[group["params"][-1]]
            last["step"] += 1
            beta1, beta2 = group["betas"]
            multi_tensor_applier(
                optimizer.multi_tensor_adam,
                optimizer._dummy_overflow_buf,
                lists,
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                last["step"],
                optimizer.adam_w_mode,
                1 if group["bias_correction"] else 0,
                group["weight_decay"],
            )
