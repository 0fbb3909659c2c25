"""Update: fp32 master copies, reduced gradients and the inner Adam, for owned tensors only (claim 3).

Masters are contiguous fp32 tensors (CPU FusedAdam silently skips non-contiguous ones): an fp32
model's own contiguous tensor, else a clone. Each
param group of the inner optimizer keeps its dict (hyper-parameters, scheduler links) and gets
only this rank's masters as ``params``, so Adam state is created for owned tensors alone.
"""
from __future__ import annotations

import torch


class OwnedShard:
    """The tensors a rank owns: fp32 masters, and reduced gradients accumulated in ``accum_dtype``.

    ``accum_dtype`` is DeepSpeed's gradient-accumulation dtype (``data_types.grad_accum_dtype``,
    else the model dtype), as stock ZeRO-2 uses; gradients become fp32 when the step begins.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owned_by_group: list[list[torch.nn.Parameter]],
                 accum_dtype: torch.dtype, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.accum_dtype = accum_dtype
        self.accumulated: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.masters: dict[torch.nn.Parameter, torch.Tensor] = {}
        for group, owned in zip(optimizer.param_groups, owned_by_group):
            masters = []
            for param in owned:
                if param.dtype == torch.float32 and param.is_contiguous():
                    master = param.detach()  # an fp32 model's own tensor serves as the master: no second copy
                else:
                    master = param.detach().to(dtype=torch.float32, copy=True).contiguous()
                self.masters[param] = master
                masters.append(master)
            group["params"] = masters

    @torch.no_grad()
    def accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add a reduced gradient of an owned tensor to its accumulator."""
        total = self.accumulated.get(param)
        if total is None:  # keep the received buffer itself (it is ours alone) rather than a copy
            self.accumulated[param] = grad.to(self.accum_dtype).view(param.shape)
        else:
            total.add_(grad.view(param.shape))

    def gradients_to_masters(self) -> None:
        """Hand the accumulated gradients to the masters as fp32 (zeros for tensors that got none)."""
        for param, master in self.masters.items():
            total = self.accumulated.pop(param, None)
            master.grad = torch.zeros_like(master) if total is None else total.to(torch.float32)

    @torch.no_grad()
    def squared_grad_norm(self) -> torch.Tensor:
        """Sum of squares of every owned master gradient."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for master in self.masters.values():
            if master.grad is not None:
                total += master.grad.double().pow(2).sum()
        return total

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        for master in self.masters.values():
            if master.grad is not None:
                master.grad.mul_(factor)

    @torch.no_grad()
    def step(self) -> None:
        """Run the inner optimizer on the masters, then write them into the model's tensors."""
        self.optimizer.step()
        self._align_step_counts()
        for param, master in self.masters.items():
            if master.data_ptr() != param.data_ptr():
                param.data.copy_(master)

    def _align_step_counts(self) -> None:
        """FusedAdam advances an int ``step`` on a group's last tensor only; give every tensor the group's count."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            stepped = [m for m in group["params"] if "step" in state.get(m, {})]
            steps = [state[m]["step"] for m in stepped]
            if steps and all(isinstance(step, int) for step in steps):
                for master in stepped:
                    state[master]["step"] = max(steps)

    def drop_grads(self) -> None:
        self.accumulated.clear()
        for master in self.masters.values():
            master.grad = None

    @torch.no_grad()
    def reload_from_params(self) -> None:
        """Refresh masters from the (possibly newly loaded) model tensors."""
        for param, master in self.masters.items():
            if master.data_ptr() != param.data_ptr():
                master.copy_(param.detach())

