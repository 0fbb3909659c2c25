"""ZeRO-Offload of DeepSpeed's Muon (``MuonWithAuxAdam``): Newton-Schulz on the accelerator, the rest on the host.

Each owned Muon matrix's reduced gradient stays on the accelerator, where it was reduced (it is counted in the
norm and unscaled and clipped there, as a host gradient is on the host). At the matrix's update the owner lends
its momentum (host state, as every other offloaded optimizer state) to the accelerator, runs DeepSpeed's
``muon_update`` there on the whole clipped gradient, stores the momentum back and copies the orthogonalized
update to the host. The host step then runs ``MuonWithAuxAdam.step`` on a flat view of the host master whose
gradient is that update: its branch for a pre-orthogonalized (1-D) Muon tensor, which applies only the weight
decay and the lr step. So the training is the unsharded run's (stage 0) and the non-offloaded one's: the same
``muon_update`` on the same gradient and momentum, then the same two element-wise operations. The auxiliary
Adam's parameters are updated by the optimizer DeepSpeed builds for offload (DeepSpeedCPUAdam) on the host.
"""

from __future__ import annotations

import torch

from ds_tensorshard.datapath.host import HostMemory

MOMENTUM = "momentum_buffer"  # MuonWithAuxAdam's state key for a matrix's momentum


def device_matrices(optimizer: torch.optim.Optimizer) -> set[torch.nn.Parameter]:
    """The parameters ``MuonWithAuxAdam.step`` orthogonalizes (tagged ``use_muon``, at least 2-D), while its
    param groups still hold the model's parameters; none for any other optimizer."""
    if type(optimizer).__name__ != "MuonWithAuxAdam":
        return set()
    return {p for g in optimizer.param_groups if g.get("use_muon") for p in g["params"] if p.dim() >= 2}


class DeviceMuon:
    """The Muon update of offloaded masters, computed on ``device`` with the momentum lent from ``host``."""

    def __init__(self, optimizer: torch.optim.Optimizer, host: HostMemory, device: torch.device) -> None:
        self.optimizer, self.host, self.device = optimizer, host, device

    @torch.no_grad()
    def pre_orthogonalized(self, master: torch.Tensor, group: dict, grad: torch.Tensor) -> torch.Tensor:
        """A flat view of the host ``master`` carrying, as its gradient, the Muon update of the accelerator
        ``grad`` (clipped; consumed: ``muon_update`` blends the momentum into it). The master's momentum
        (``state[master]``, in host memory, zeros at its first step as the optimizer makes it) is updated."""
        from deepspeed.runtime.zero.muon.original_muon import muon_update  # importing it compiles Muon's kernels

        state = self.optimizer.state[master]
        if MOMENTUM in state:
            momentum = self.host.lend(state[MOMENTUM], self.device)
        else:
            momentum = torch.zeros(master.shape, dtype=master.dtype, device=self.device)
            state[MOMENTUM] = self.host.empty(master.shape, master.dtype)
        update = muon_update(  # as MuonWithAuxAdam.step calls it on an unsharded master
            grad,
            momentum,
            beta=group["momentum"],
            ns_method=group.get("ns_method", "gram"),
            is_expert_group=getattr(master, "is_expert_group", False),
        )
        self.host.store(momentum, state[MOMENTUM])
        flat = master.view(-1)
        flat.grad = self.host.fetch(update.reshape(-1))
        return flat
