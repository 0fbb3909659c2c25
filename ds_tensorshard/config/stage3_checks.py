"""Which ZeRO stage-3 configs ds_tensorshard runs (parameters owned whole), and the refusal of each stage-3 key or
combination that is not exact against stock ZeRO-3 yet, naming it, before anything is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_tensorshard.config.schema import BLOCK
from ds_tensorshard.errors import TensorShardConfigError

# key -> (whether the config sets it to something refused, why)
REFUSED_STAGE3_KEYS: dict[str, tuple[Any, str]] = {
    "zero_hpz_partition_size": (
        lambda v: int(v or 1) > 1,
        "ZeRO++'s secondary partition of the parameters within a node (hpZ) is not built for owned tensors",
    ),
    "zero_quantized_weights": (bool, "ZeRO++'s quantized parameter gathers (qwZ) are not built for owned tensors"),
    "zero_quantized_nontrainable_weights": (bool, "quantized frozen parameters are not built for owned tensors"),
    "zero_quantized_gradients": (bool, "ZeRO++'s quantized gradient reduction (qgZ) is not built for owned tensors"),
    "stage3_use_all_reduce_for_fetch_params": (bool, "owned tensors are gathered from their owners by broadcasts"),
    "use_all_reduce_for_fetch_params": (bool, "owned tensors are gathered from their owners by broadcasts"),
    "stage3_allgather_sequential": (bool, "owned tensors are gathered one collective per batch"),
    "allgather_sequential": (bool, "owned tensors are gathered one collective per batch"),
    "stage3_module_granularity_threshold": (lambda v: int(v or 0) > 0, "not checked against stock with owned tensors"),
    "module_granularity_threshold": (lambda v: int(v or 0) > 0, "not checked against stock with owned tensors"),
    "zenflow": (lambda v: v is not None, "ZenFlow's stage-3 engine replaces the optimizer ds_tensorshard provides"),
}


def offload_device(zero: Mapping[str, Any], key: str, flag: str | None = None) -> str | None:
    """The device ``zero_optimization.key`` offloads to (None: no offload); ``flag``: its deprecated boolean."""
    block = zero.get(key)
    if block is None and flag is not None and zero.get(flag) is not None:
        return "cpu" if zero.get(flag) else None
    device = (block or {}).get("device") if isinstance(block, Mapping) else None
    return None if device in (None, "none") else str(getattr(device, "value", device))


def validate_stage3(param_dict: Mapping[str, Any], tensorshard: Mapping[str, Any]) -> None:
    """Refuse what stage 3 with owned parameters does not reproduce yet (each named); the rest runs."""
    zero = param_dict.get("zero_optimization") or {}
    for key, (refused, why) in REFUSED_STAGE3_KEYS.items():
        if key in zero and refused(zero[key]):
            raise TensorShardConfigError(
                f"'zero_optimization.{key}' {zero[key]!r} is not supported at ZeRO stage 3 with '{BLOCK}.enabled': "
                f"{why}; remove it or disable '{BLOCK}.enabled'"
            )
    for key, flag in (("offload_param", "cpu_offload_param"), ("offload_optimizer", "cpu_offload")):
        device = offload_device(zero, key, flag)
        if device not in (None, "cpu"):
            raise TensorShardConfigError(
                f"'zero_optimization.{key}' (device {device!r}) is not supported at ZeRO stage 3 with "
                f"'{BLOCK}.enabled': NVMe offload is not built for owned tensors; use device 'cpu', or disable "
                f"'{BLOCK}.enabled'"
            )
    if (param_dict.get("super_offload") or {}).get("enabled"):
        raise TensorShardConfigError(f"'super_offload' is not supported with '{BLOCK}.enabled'; remove it")
    if float(param_dict.get("gradient_predivide_factor", 1.0)) != 1.0 and not param_dict.get("prescale_gradients"):
        raise TensorShardConfigError(
            f"'gradient_predivide_factor' != 1.0 is not supported at ZeRO stage 3 with '{BLOCK}.enabled': "
            "ds_tensorshard divides each gradient by the world size before the sum, as stock does without it"
        )
    if tensorshard.get("bucket_layout") == "flat":
        raise TensorShardConfigError(
            f"'{BLOCK}.bucket_layout' 'flat' at ZeRO stage 3: flat parameters are views of one storage, which "
            "stage 3 releases tensor by tensor; use 'auto', 'windows' or 'stripes'"
        )
    autotp = (param_dict.get("tensor_parallel") or {}).get("autotp_size", 0) or 0
    if autotp > 1:
        raise TensorShardConfigError(
            f"'tensor_parallel.autotp_size' {autotp} at ZeRO stage 3 with '{BLOCK}.enabled': tensor parallelism "
            f"with owned parameters is not supported; disable '{BLOCK}.enabled'"
        )


def validate_stage3_layout(model: Any, mpu: Any) -> None:
    """The parallel layouts stage 3 with owned parameters refuses: model parallelism (an ``mpu``: tensor, pipeline
    or sequence parallelism) and mixture-of-experts layers."""
    if mpu is not None:
        raise TensorShardConfigError(
            f"an mpu (tensor, pipeline or sequence parallelism) at ZeRO stage 3 with '{BLOCK}.enabled': only data "
            f"parallelism is supported with owned parameters; disable '{BLOCK}.enabled'"
        )
    expert = next((name for name, p in model.named_parameters() if getattr(p, "allreduce", True) is False), None)
    if expert is not None:
        raise TensorShardConfigError(
            f"a mixture-of-experts model (expert parameter '{expert}', allreduce=False) at ZeRO stage 3 with "
            f"'{BLOCK}.enabled': MoE with owned parameters is not supported; disable '{BLOCK}.enabled'"
        )
