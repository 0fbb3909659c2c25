"""The inner optimizer, run by each rank on the tensors it owns: which ones are accepted, which of them
need whole matrices, and how their per-tensor state is kept to owned tensors.

Element-wise optimizers (Adam, AdamW, Lion, Adagrad, SGD, RMSprop, ...) give the same update to any
piece of a tensor, so the plan may own a large tensor in blocks. Optimizers that look at a whole
matrix (Muon's Newton-Schulz, Adafactor's factored second moment, LAMB's trust ratio, and any client
optimizer not known to be element-wise) never have a tensor split: each tensor is updated whole, on
one rank, exactly as an unsharded run updates it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import torch

from ds_tensorshard.errors import TensorShardConfigError

ELEMENTWISE = frozenset(
    {
        "FusedAdam",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "SGD",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adadelta",
        "Adagrad",
        "FusedLion",
        "SparseAdam",
        "DeepSpeedCPUAdam",
        "DeepSpeedCPUAdagrad",
        "DeepSpeedCPULion",
    }
)
HOST_OPTIMIZERS = frozenset({"DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion"})
# DeepSpeed's optimizers that compress or offload their own communication, or need parameter metadata
# (mup's infinite-width shapes) that owned fp32 masters do not carry
REFUSED = {
    "OnebitAdam": "it compresses its own gradient communication",
    "ZeroOneAdam": "it compresses its own gradient communication",
    "OnebitLamb": "it compresses its own gradient communication",
    "MuAdam": "it reads mup's infshape attributes from the parameters, which owned masters do not carry",
    "MuAdamW": "it reads mup's infshape attributes from the parameters, which owned masters do not carry",
    "MuSGD": "it reads mup's infshape attributes from the parameters, which owned masters do not carry",
}
# with 'zero_optimization.offload_optimizer' device cpu: the masters are in host memory, so the inner optimizer
# must run there (stock builds DeepSpeedCPUAdam, DeepSpeedCPUAdagrad or DeepSpeedCPULion from the config)
REFUSED_OFFLOADED = {
    "FusedAdam": "its kernel runs on the accelerator, and the offloaded masters are in host memory (the 'Adam' "
    "and 'AdamW' config types run DeepSpeedCPUAdam there, as stock)",
    "FusedLion": "its kernel runs on the accelerator, and the offloaded masters are in host memory (the 'Lion' "
    "config type runs DeepSpeedCPULion there, as stock)",
    "FusedLamb": "DeepSpeed has no CPU LAMB: stock builds the accelerator kernel FusedLamb, which cannot update "
    "masters in host memory",
}
REFUSED_OFFLOADED_TYPES = {"lamb": "FusedLamb"}
REFUSED_TYPES = {
    "onebitadam": "OnebitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OnebitLamb",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}


def check_supported(optimizer: torch.optim.Optimizer, offload: bool = False) -> None:
    """Refuse inner optimizers ds_tensorshard cannot run on owned tensors (in host memory with ``offload``: the
    config's 'zero_optimization.offload_optimizer' device cpu), naming the reason."""
    name = type(optimizer).__name__
    if name in REFUSED:
        raise TensorShardConfigError(f"optimizer {name} cannot be sharded by ds_tensorshard: {REFUSED[name]}")
    if offload and name in REFUSED_OFFLOADED:
        raise TensorShardConfigError(
            f"optimizer {name} is not supported with 'zero_optimization.offload_optimizer' device cpu: "
            f"{REFUSED_OFFLOADED[name]}"
        )
    aux = type(getattr(optimizer, "aux_optimizer", None)).__name__  # MuonWithAuxAdam's Adam (NoneType: inline)
    if offload and name == "MuonWithAuxAdam" and aux in REFUSED_OFFLOADED:
        raise TensorShardConfigError(
            f"optimizer {name} is not supported with 'zero_optimization.offload_optimizer' device cpu with {aux} "
            f"as its auxiliary Adam: {REFUSED_OFFLOADED[aux]}"
        )
    if not offload and name in HOST_OPTIMIZERS:
        raise TensorShardConfigError(
            f"optimizer {name} updates tensors in host memory only: set 'zero_optimization.offload_optimizer' "
            '{"device": "cpu"} (stock ZeRO-Offload), or use the config\'s optimizer block without it'
        )
    if name == "FusedAdam" and any(group.get("amsgrad") for group in optimizer.param_groups):
        raise TensorShardConfigError("optimizer param group key 'amsgrad' is not supported with FusedAdam")


def refuse_add_param_group(param_group: dict) -> NoReturn:
    """Refused: the ownership plan, buckets and hooks are built for the groups given at initialize."""
    raise TensorShardConfigError(
        "add_param_group is not supported by ds_tensorshard: ownership, buckets and gradient hooks are planned "
        "once, for the param groups given to deepspeed.initialize; pass every group there (a group may start "
        "with lr 0)"
    )


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ in ELEMENTWISE


def whole_matrix_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters whose update needs the whole tensor: Muon's matrices (its auxiliary Adam is
    element-wise), or every parameter of an optimizer not known to be element-wise."""
    if is_elementwise(optimizer):
        return []
    if type(optimizer).__name__ == "MuonWithAuxAdam":
        return [p for group in optimizer.param_groups if group.get("use_muon") for p in group["params"]]
    return [p for group in optimizer.param_groups for p in group["params"]]


def keep_owned_state(optimizer: torch.optim.Optimizer, masters: Iterable[torch.Tensor], eager: bool) -> None:
    """After the param groups were given this rank's masters: drop state built for other tensors and, for an
    optimizer that builds its state at construction (``eager``, e.g. Adagrad's ``sum``), build it for the
    masters the way its constructor does, group settings included."""
    owned = {id(m) for m in masters}
    for key in [k for k in optimizer.state if id(k) not in owned]:
        del optimizer.state[key]
    if eager:
        fresh = type(optimizer)([dict(group) for group in optimizer.param_groups], **optimizer.defaults)
        optimizer.state.update(fresh.state)


def step_value(optimizer: torch.optim.Optimizer, master: torch.Tensor, step: Any) -> Any:
    """A saved ``step`` as the inner optimizer keeps it: an int for DeepSpeed's optimizers; for torch's an
    fp32 tensor, on the parameter's device when the group is ``fused`` or ``capturable`` (as torch loads
    it); for a client optimizer, as it was saved."""
    module = type(optimizer).__module__
    if module.startswith("deepspeed."):
        return int(step.item() if torch.is_tensor(step) else step)
    if module.startswith("torch.optim"):
        group = next(g for g in optimizer.param_groups if any(m is master for m in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        value = float(step.item() if torch.is_tensor(step) else step)
        return torch.tensor(value, dtype=torch.float32, device=master.device if on_device else "cpu")
    return step


def newton_schulz_work(shape: tuple[int, ...]) -> float:
    """Relative cost of orthogonalizing a matrix (its leading dimension by the rest): m n min(m, n)."""
    m = shape[0]
    n = 1
    for size in shape[1:]:
        n *= size
    return float(m * n * min(m, n))


def orthogonalized_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The matrices a Muon optimizer runs Newton-Schulz on (none for other optimizers)."""
    name = type(optimizer).__name__
    if name == "MuonWithAuxAdam":
        return [p for g in optimizer.param_groups if g.get("use_muon") for p in g["params"] if p.dim() >= 2]
    if name == "Muon":
        return [p for g in optimizer.param_groups for p in g["params"] if p.dim() >= 2]
    return []
