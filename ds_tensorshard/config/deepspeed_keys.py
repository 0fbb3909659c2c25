"""DeepSpeed's own config keys read as stock reads them: offload blocks (and their deprecated flags), flags
written as strings, blocks under their current or older name, and whether the installed release reads a key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GRADIENT_ALLREDUCE_OP_RELEASE = (0, 19, 6)
COMPUTE_GRAD_NORM_RELEASE = (0, 19, 7)  # zero_optimization.compute_grad_norm

# DeepSpeed's deprecated ZeRO flags and the key each one sets (DeepSpeedZeroConfig: true means device cpu, false none)
DEPRECATED_OFFLOAD = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}


def offload_device(block: Any) -> str | None:
    """The device of an ``offload_*`` block: a string, or DeepSpeed's ``OffloadDeviceEnum`` (a str enum, whose
    ``str()`` is its name on Python 3.11, ``'OffloadDeviceEnum.cpu'``); None where nothing is offloaded."""
    if isinstance(block, Mapping):
        device = block.get("device", "none")
        device = getattr(device, "value", device)
        return None if device in (None, "none") else str(device)
    return None


def offload_block(zero: Mapping[str, Any], key: str) -> Any:
    """``zero_optimization.<key>`` as stock reads it: its deprecated flag (``cpu_offload``, ``cpu_offload_param``),
    where set, stands for ``{"device": "cpu"}`` (true) or no block (false); DeepSpeed refuses both at once."""
    flag = zero.get(DEPRECATED_OFFLOAD[key])
    if flag is not None:
        return {"device": "cpu"} if truthy(flag) else None
    return zero.get(key)


def offloads_optimizer(param_dict: Mapping[str, Any]) -> bool:
    """Whether the config asks for ZeRO-Offload of the optimizer: ``zero_optimization.offload_optimizer`` with
    device cpu (each owner's fp32 masters and optimizer state in host memory)."""
    zero = param_dict.get("zero_optimization", {}) or {}
    return offload_device(offload_block(zero, "offload_optimizer")) == "cpu"


def truthy(value: Any) -> bool:
    """A config flag as DeepSpeed's pydantic models read it ("false", "0", "no" ... are false)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "f", "no", "n", "off")
    return bool(value)


def sub_block(param_dict: Mapping[str, Any], *names: str) -> Mapping[str, Any]:
    """The first of ``names`` that the config has as an object (DeepSpeed's current name first), else {}."""
    for name in names:
        value = param_dict.get(name)
        if isinstance(value, Mapping):
            return value
    return {}


def release_reads(release: tuple[int, ...]) -> bool:
    """Whether the installed DeepSpeed reads a key its ``release`` added (an older one ignores it, as we do)."""
    from ds_tensorshard.versions import installed_release

    return installed_release() >= release


def sums_gradients(param_dict: Mapping[str, Any]) -> bool:
    """``gradient_allreduce_op: "sum"`` (DeepSpeed 0.19.6): gradients are summed over data-parallel ranks, not
    averaged; ds_tensorshard follows it through ``engine.gradient_average``, as stock ZeRO-1/2 does."""
    op = str(param_dict.get("gradient_allreduce_op", "mean")).lower()
    return op == "sum" and release_reads(GRADIENT_ALLREDUCE_OP_RELEASE)
