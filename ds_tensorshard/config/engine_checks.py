"""Which engine configs ds_tensorshard accepts, leaves to stock DeepSpeed, or refuses.

``validate_engine_config`` runs at the start of ``DeepSpeedEngine.__init__``, before the model is moved or any
optimizer state exists: the ZeRO stage, offload, the loss scaling stock ZeRO-2 asserts, fp16 on the installed
release and the optimizer; each refusal a :class:`TensorShardConfigError` naming the offending key."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ds_tensorshard.config.deepspeed_keys import (
    COMPUTE_GRAD_NORM_RELEASE,
    offload_block,
    offload_device,
    offloads_optimizer,
    release_reads,
    sums_gradients,
    truthy,
)
from ds_tensorshard.config.schema import BLOCK, TensorShardConfig, from_environment, parse_block
from ds_tensorshard.config.stage3_checks import validate_stage3
from ds_tensorshard.config.unfollowed_keys import refuse_unfollowed_keys
from ds_tensorshard.errors import RefusedAsStock, TensorShardConfigError

STOCK_ALIGNMENT = 2  # stock ZeRO-1/2's nccl_start_alignment_factor: 4-byte all-gather buffers of 2-byte elements


def validate_engine_config(param_dict: Mapping[str, Any], client_optimizer: Any = None) -> TensorShardConfig | None:
    """Check a whole DeepSpeed config for ds_tensorshard; ``None`` when the plugin is not enabled or the engine
    has no ZeRO optimizer to replace (stage 0, no optimizer; stage 3 under the environment switch)."""
    config = parse_block(param_dict)
    if not config.enabled:
        return None
    zero = param_dict.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage == 0 or (stage == 3 and from_environment(param_dict)):
        _runs_as_stock(f"'zero_optimization.stage' {stage}")
        return None
    if stage not in (1, 2, 3):
        raise TensorShardConfigError(
            f"'{BLOCK}.enabled' needs 'zero_optimization.stage' 1 (reduce at the accumulation boundary), 2 "
            f"(reduce every micro-step) or 3 (parameters owned whole too); got stage {stage!r}"
        )
    if stage == 3:
        validate_stage3(param_dict, param_dict.get(BLOCK) or {})
    else:
        _check_offload(zero)
        _refuse_as_stock(zero)
    refuse_unfollowed_keys(param_dict, zero)
    _check_stage_2_scaling(param_dict, zero, stage)
    _check_fp16(param_dict, stage)
    if not _check_optimizer(param_dict, client_optimizer):
        _runs_as_stock("no optimizer (no 'optimizer' block, none given to deepspeed.initialize)")
        return None
    return config


def _check_stage_2_scaling(param_dict: Mapping[str, Any], zero: Mapping[str, Any], stage: int) -> None:
    """What stock ZeRO-2 asserts about gradient scaling (stage_1_and_2.py), except under
    ``gradient_allreduce_op`` "sum", which ignores it."""
    if stage != 2 or not zero.get("reduce_scatter", True) or sums_gradients(param_dict):
        return
    if param_dict.get("gradient_predivide_factor", 1.0) != 1.0:
        raise TensorShardConfigError(
            "'gradient_predivide_factor' != 1.0 is not supported with ZeRO stage 2 and "
            "'zero_optimization.reduce_scatter' (stock DeepSpeed refuses it too); "
            "set reduce_scatter to false or remove the factor"
        )
    if param_dict.get("prescale_gradients", False):
        raise TensorShardConfigError(
            "'prescale_gradients' is not supported with ZeRO stage 2 and "
            "'zero_optimization.reduce_scatter' (stock DeepSpeed refuses it too); "
            "set reduce_scatter to false or remove it"
        )


def _check_fp16(param_dict: Mapping[str, Any], stage: int) -> None:
    """``fp16.enabled`` is refused on the releases whose stock ZeRO at this stage cannot run it."""
    if (param_dict.get("fp16") or {}).get("enabled") is not True:
        return
    from ds_tensorshard.versions import fp16_refusal, installed_release

    release = installed_release()
    why = fp16_refusal(stage, release)
    if why is not None:
        stage_1_works = stage == 2 and fp16_refusal(1, release) is None
        raise TensorShardConfigError(
            f"'fp16.enabled' with ZeRO stage {stage} is refused on deepspeed {'.'.join(map(str, release))}: "
            f"{why}, so there is no stock run to match; use bf16 or fp32, or deepspeed >= 0.18.3"
            + (" (or stage 1)" if stage_1_works else "")
        )


def _check_optimizer(param_dict: Mapping[str, Any], client_optimizer: Any) -> bool:
    """Refuse the optimizers ds_tensorshard cannot shard (with offload, those it cannot run in host memory);
    False where the engine has none (neither an ``optimizer`` block nor one given to ``deepspeed.initialize``)."""
    from ds_tensorshard.datapath.inner_optimizer import (
        REFUSED,
        REFUSED_OFFLOADED,
        REFUSED_OFFLOADED_TYPES,
        REFUSED_TYPES,
        check_supported,
    )

    offload = offloads_optimizer(param_dict)
    if client_optimizer is None:
        opt_type = (param_dict.get("optimizer") or {}).get("type")
        if opt_type is None:
            return False
        refused = REFUSED_TYPES.get(str(opt_type).lower())
        if refused is not None:
            raise TensorShardConfigError(
                f"'optimizer.type' {opt_type!r} cannot be sharded by ds_tensorshard: {REFUSED[refused]}"
            )
        refused = REFUSED_OFFLOADED_TYPES.get(str(opt_type).lower()) if offload else None
        if refused is not None:
            raise TensorShardConfigError(
                f"'optimizer.type' {opt_type!r} is not supported with 'zero_optimization.offload_optimizer' "
                f"device cpu: {REFUSED_OFFLOADED[refused]}"
            )
    elif isinstance(client_optimizer, torch.optim.Optimizer):
        check_supported(client_optimizer, offload)
    return True


def _check_offload(zero: Mapping[str, Any]) -> None:
    """``offload_optimizer`` device cpu (or the deprecated ``cpu_offload: true``, as stock reads it) is followed;
    NVMe and ``offload_param`` are refused, naming the key."""
    device = optimizer_device = offload_device(offload_block(zero, "offload_optimizer"))
    if device not in (None, "cpu"):
        raise TensorShardConfigError(
            f"'zero_optimization.offload_optimizer' device {device!r} is not supported with '{BLOCK}.enabled': "
            "stock ZeRO-1/2 has no NVMe optimizer offload either (DeepSpeed swaps optimizer state to NVMe at "
            'ZeRO stage 3 only); use {"device": "cpu"}'
        )
    device = offload_device(offload_block(zero, "offload_param"))
    if device is not None:
        key = "cpu_offload_param" if zero.get("cpu_offload_param") is not None else "offload_param"
        raise TensorShardConfigError(
            f"'zero_optimization.{key}' (device {device!r}) is not supported with '{BLOCK}.enabled': "
            "parameter offload is a ZeRO stage 3 feature (ZeRO-1/2 keep every parameter on the accelerator); "
            "remove it"
        )
    if (
        optimizer_device == "cpu"
        and not truthy(zero.get("compute_grad_norm", True))
        and release_reads(COMPUTE_GRAD_NORM_RELEASE)
    ):
        raise TensorShardConfigError(  # stock ZeRO-1/2's constructor raises it too (0.19.7)
            "'zero_optimization.compute_grad_norm' false is not supported with 'zero_optimization.offload_optimizer' "
            "(stock DeepSpeed refuses it too); remove one of them"
        )


def _refuse_as_stock(zero: Mapping[str, Any]) -> None:
    """What stock ZeRO-1/2's constructor asserts about its own keys, refused with stock's message."""
    size = zero.get("allgather_bucket_size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and int(size) % STOCK_ALIGNMENT != 0:
        raise RefusedAsStock(
            f"'zero_optimization.allgather_bucket_size' {size!r}: allgather_bucket_size must be a multiple of "
            f"nccl_start_alignment_factor, {STOCK_ALIGNMENT} (stock DeepSpeed's ZeRO-1/2 refuses it too, though "
            "ds_tensorshard does not use the key); use an even number"
        )


def _runs_as_stock(why: str) -> None:
    """The engine has nothing for the plugin to replace: say so once, on rank 0, and leave it to stock (as a
    warning: DeepSpeed's logger shows nothing below it until the engine applies the config's ``log_level``)."""
    from deepspeed.utils import log_dist

    message = f"ds_tensorshard: {why}: no ZeRO-1/2 optimizer to replace, this engine runs as stock DeepSpeed"
    log_dist(message, [0], level=logging.WARNING)
