"""The DeepSpeed keys (most of them added in 0.17-0.19) whose effect on gradients, their reduction or the
optimizer ds_tensorshard does not reproduce: refused, naming the key, on the releases that read them; and
``torch_autocast``, followed with bf16 where stock ZeRO-1/2 uses no GradScaler."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_tensorshard.config.deepspeed_keys import release_reads, sub_block, truthy
from ds_tensorshard.config.schema import BLOCK
from ds_tensorshard.errors import TensorShardConfigError

AUTOCAST_RELEASE = (0, 17, 2)  # the torch_autocast block
AUTOCAST_WITHOUT_BF16_SCALER = (0, 17, 6)  # before it, stock ZeRO scales bf16 autocast gradients with a GradScaler
# (key, the release that added it, where its value is, the reason and what to do): refused when set (true, or any
# value for a block), on the releases that read it. Each changes how gradients are reduced or stepped, or where
# optimizer state lives, in a way ds_tensorshard does not follow (docs/configuration.md, "DeepSpeed 0.17-0.19 keys").
UNFOLLOWED_KEYS: tuple[tuple[str, tuple[int, ...], Callable[[Mapping[str, Any], Mapping[str, Any]], Any], str], ...] = (
    (
        "fp16.fp16_master_weights_and_grads",
        (0, 16, 0),
        lambda config, zero: sub_block(config, "fp16").get("fp16_master_weights_and_grads"),
        "ds_tensorshard keeps fp32 masters and gradients on each tensor's owner (stock allows fp16 ones only with "
        "ZeRO-Offload, where ds_tensorshard keeps them in fp32 too); remove it",
    ),
    (
        "zero_optimization.zenflow",
        (0, 17, 5),
        lambda config, zero: zero.get("zenflow") is not None,
        "ZenFlow runs its own ZeRO optimizer (selective updates of offloaded optimizer state), which "
        "ds_tensorshard replaces; remove the block, or disable 'tensorshard.enabled'",
    ),
    (
        "compile.deepcompile",
        (0, 16, 6),
        lambda config, zero: sub_block(config, "compile").get("deepcompile"),
        "DeepCompile's compiled passes reduce gradients into stock ZeRO's partitions themselves; remove it (or set "
        "it false), or disable 'tensorshard.enabled'",
    ),
    (
        "checkpoint.use_node_local_storage",
        (0, 16, 0),
        lambda config, zero: sub_block(config, "checkpoint").get("use_node_local_storage"),
        "a ds_tensorshard save is committed (moved into place, 'latest' written) by rank 0 in one folder that "
        "every rank writes to; use storage that all nodes share and remove the key",
    ),
    (
        "expert_parallel.enabled",
        (0, 19, 2),
        lambda config, zero: sub_block(config, "expert_parallel").get("enabled"),
        "AutoEP replaces a model's MoE blocks with its own expert-parallel layers inside the engine; ds_tensorshard "
        "supports deepspeed.moe.layer.MoE, but AutoEP has not been checked against stock; disable "
        "'tensorshard.enabled' for this model",
    ),
)


def refuse_unfollowed_keys(param_dict: Mapping[str, Any], zero: Mapping[str, Any]) -> None:
    """Refuse the keys (most of them added in DeepSpeed 0.17-0.19) whose effect on gradients, their reduction or
    the optimizer ds_tensorshard does not reproduce; each only on the releases that read it."""
    for key, release, value_of, what in UNFOLLOWED_KEYS:
        value = value_of(param_dict, zero)
        if truthy(value) and release_reads(release):
            shown = "" if value is True else f" ({value!r})"
            raise TensorShardConfigError(f"'{key}'{shown} is not supported with '{BLOCK}.enabled': {what}")
    if not truthy(zero.get("compute_grad_norm", True)) and float(param_dict.get("gradient_clipping") or 0.0) > 0.0:
        raise TensorShardConfigError(  # stock ZeRO-1/2's constructor raises it (0.19.7); ds_tensorshard replaces it
            "'zero_optimization.compute_grad_norm' false needs 'gradient_clipping' 0 (stock DeepSpeed refuses "
            "clipping without a norm too); remove one of them"
        )
    bf16_fp32_accum = truthy(sub_block(param_dict, "bf16", "bfloat16").get("enabled", False)) and str(
        sub_block(param_dict, "data_types").get("grad_accum_dtype")
    ).lower() in ("fp32", "float32", "float", "torch.float32")
    if zero.get("stage") == 1 and bf16_fp32_accum and not truthy(zero.get("compute_grad_norm", True)):
        # stock raises it in _do_optimizer_sanity_check (0.19.7), which ds_tensorshard replaces for this route
        raise TensorShardConfigError(
            "'zero_optimization.compute_grad_norm' false is not supported with ZeRO stage 1, bf16 and "
            "'data_types.grad_accum_dtype' fp32 (stock DeepSpeed refuses it too); remove it or accumulate in bf16"
        )
    autocast = sub_block(param_dict, "torch_autocast")
    if truthy(autocast.get("enabled", False)) and release_reads(AUTOCAST_RELEASE):
        _check_autocast(autocast)


def _check_autocast(autocast: Mapping[str, Any]) -> None:
    """``torch_autocast`` (DeepSpeed 0.17.2): followed with dtype bf16 from 0.17.6 on, where stock ZeRO-1/2 sends
    the gradients of the tensors DeepSpeed marks (Linear and Conv weights by default) in bf16 and uses no
    GradScaler; refused otherwise."""
    from deepspeed.runtime.config import DtypeEnum

    from ds_tensorshard.versions import installed_release

    if not release_reads(AUTOCAST_WITHOUT_BF16_SCALER):
        raise TensorShardConfigError(
            f"'torch_autocast.enabled' is refused with '{BLOCK}.enabled' on deepspeed "
            f"{'.'.join(map(str, installed_release()))}: its stock ZeRO steps autocast training through a torch "
            "GradScaler, which ds_tensorshard does not follow; use deepspeed >= 0.17.6 (or bf16.enabled instead)"
        )
    dtype = autocast.get("dtype")
    if dtype is None:
        raise TensorShardConfigError(
            "'torch_autocast.enabled' without 'torch_autocast.dtype' is not supported with "
            f"'{BLOCK}.enabled'; set 'torch_autocast.dtype' to \"bf16\""
        )
    if DtypeEnum(dtype).value is not torch.bfloat16:
        raise TensorShardConfigError(
            f"'torch_autocast.dtype' {dtype!r} is not supported with '{BLOCK}.enabled': only bf16 is (with fp16 "
            "autocast stock ZeRO steps through a torch GradScaler, which ds_tensorshard does not follow); use "
            '"bf16", or fp16.enabled'
        )
