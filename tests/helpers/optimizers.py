"""Inner optimizers for the tests: how each is set up in a DeepSpeed config (or as a client optimizer),
and small reference implementations of two published algorithms that DeepSpeed only ships for CUDA.

``Lion`` (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") is element-wise;
``Lamb`` (You et al., 2020, "Large Batch Optimization for Deep Learning") scales each tensor's Adam
update by a trust ratio ||w|| / ||update|| computed over the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ELEMENTWISE = ("adagrad", "sgd", "rmsprop", "lion")
# muon: DeepSpeed's Muon with Newton-Schulz forced to fp32; muonhalf: the same in a GPU's half precision
# (optim_worker.force_newton_schulz); torch's Muon always orthogonalizes in bf16
WHOLE_MATRIX = ("muon", "muonhalf", "adafactor", "lamb", "torchmuon")


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                direction = (state["exp_avg"] * beta1 + p.grad * (1 - beta1)).sign_()
                p.add_(direction, alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Lamb(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)


CONFIG_TYPES = {  # name -> (DeepSpeed optimizer.type, params)
    "adagrad": ("Adagrad", dict(lr=1e-2, weight_decay=0.0, initial_accumulator_value=0.1)),
    "sgd": ("SGD", dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
    "rmsprop": ("RMSprop", dict(lr=1e-3, alpha=0.9, momentum=0.5)),
    "adafactor": ("Adafactor", dict(lr=1e-2, weight_decay=0.0)),
    "muon": ("Muon", dict(lr=1e-2, momentum=0.95, weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8)),
    # DeepSpeed's CUDA kernels (launch/gpu_check.sh): FusedLamb (whole-matrix) and FusedLion (element-wise)
    "fusedlamb": ("Lamb", dict(lr=1e-2, weight_decay=0.01)),
    "fusedlion": ("Lion", dict(lr=1e-3, weight_decay=0.1)),
}
CLIENT_LR = {"lion": 1e-3, "lamb": 1e-2, "torchmuon": 1e-2}


def setup(name: str, model: torch.nn.Module, config: dict) -> Callable | None:
    """Set ``config`` up for optimizer ``name`` (tagging the model for Muon, freezing its vectors for torch's
    Muon); returns a client optimizer factory for the optimizers a config cannot name, else None. The
    scheduler warms every group up to the optimizer's lr."""
    config["zero_allow_untested_optimizer"] = True  # stock ZeRO needs it for anything but Adam
    lr = CONFIG_TYPES[name][1]["lr"] if name in CONFIG_TYPES else CLIENT_LR[name]
    config["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=lr)
    if name in CONFIG_TYPES:
        opt_type, params = CONFIG_TYPES[name]
        config["optimizer"] = {"type": opt_type, "params": dict(params)}
        if name == "muon":
            for pname, p in model.named_parameters():  # matrices inside the blocks; embeddings stay on Adam
                p.use_muon = p.dim() >= 2 and pname.startswith("blocks.")
        return None
    config.pop("optimizer", None)
    if name == "lion":
        return lambda params: Lion(params, lr=lr, weight_decay=0.1)
    if name == "lamb":
        return lambda params: Lamb(params, lr=lr, weight_decay=0.01)
    if name == "torchmuon":  # torch's Muon takes matrices only: the model's vectors are frozen for it
        for p in model.parameters():
            p.requires_grad_(p.dim() == 2)
        return lambda params: torch.optim.Muon(
            [p for group in params for p in group["params"] if p.requires_grad],
            lr=lr,
            weight_decay=0.0,
            adjust_lr_fn="match_rms_adamw",
        )
    raise ValueError(f"unknown optimizer {name!r}")
