"""The parallel layouts ds_tensorshard supports (data, tensor, pipeline and Ulysses sequence parallelism, DeepSpeed
MoE with data parallelism alone), and the refusal, naming it, of every other one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_tensorshard.config.deepspeed_keys import offload_block, offload_device, truthy
from ds_tensorshard.config.schema import BLOCK
from ds_tensorshard.config.stage3_checks import validate_stage3_layout
from ds_tensorshard.errors import TensorShardConfigError


def validate_parallel_layout(model: Any, mpu: Any, param_dict: Mapping[str, Any]) -> None:
    """Refuse the parallel layouts ds_tensorshard does not support, naming them, before anything is built.

    Supported: data parallelism, tensor parallelism through an ``mpu`` (Megatron-style) or DeepSpeed's AutoTP
    (``tensor_parallel.autotp_size``, whose engine sets its own ``mpu``), pipeline
    parallelism (a ``PipelineModule``, ZeRO stage 1 as stock allows), Ulysses sequence parallelism
    through an ``mpu``, and DeepSpeed MoE layers (expert parallelism) with data parallelism alone."""
    from deepspeed.pipe import PipelineModule

    stage = (param_dict.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        validate_stage3_layout(model, mpu)
    if isinstance(model, PipelineModule) and stage >= 2:
        raise TensorShardConfigError(
            "a PipelineModule with 'zero_optimization.stage' 2: ZeRO-2 and ZeRO-3 are incompatible with "
            "pipeline parallelism (stock DeepSpeed refuses it too); use stage 1"
        )
    accum = (param_dict.get("data_types") or {}).get("grad_accum_dtype")
    low_precision = (param_dict.get("bf16") or {}).get("enabled") or (param_dict.get("fp16") or {}).get("enabled")
    if isinstance(model, PipelineModule) and low_precision and accum in ("fp32", "float32", "float"):
        raise TensorShardConfigError(
            "a PipelineModule with 'data_types.grad_accum_dtype' fp32 in bf16/fp16 training is not supported by "
            f"ds_tensorshard (stock runs it through its BF16_Optimizer); remove the key or disable '{BLOCK}.enabled'"
        )
    if param_dict.get("sequence_parallel_size", 1) > 1:
        raise TensorShardConfigError(
            f"'sequence_parallel_size' {param_dict['sequence_parallel_size']} (DeepSpeed's device-mesh sequence "
            "parallelism) is not supported by ds_tensorshard; give deepspeed.initialize an mpu with sequence-parallel "
            "groups instead (Megatron-DeepSpeed style, tested with Ulysses DistributedAttention)"
        )
    expert = next((name for name, p in model.named_parameters() if getattr(p, "allreduce", True) is False), None)
    if expert is not None:
        _check_moe_layout(expert, isinstance(model, PipelineModule), mpu, param_dict)


def _check_moe_layout(expert: str, pipeline: bool, mpu: Any, param_dict: Mapping[str, Any]) -> None:
    """A model with DeepSpeed MoE layers (``expert``: its first expert parameter) is supported with data
    parallelism alone; what stock ZeRO-1/2 itself asserts for MoE is refused as such."""
    zero = param_dict.get("zero_optimization") or {}
    where = f"a mixture-of-experts model (expert parameter '{expert}', allreduce=False)"
    if pipeline:
        raise TensorShardConfigError(
            f"{where} in a PipelineModule: MoE with pipeline parallelism is not supported by ds_tensorshard; "
            f"disable '{BLOCK}.enabled' for this model"
        )
    autotp = (param_dict.get("tensor_parallel") or {}).get("autotp_size", 0) or 0
    if mpu is not None or autotp > 1:
        given = "an mpu" if mpu is not None else f"'tensor_parallel.autotp_size' {autotp}"
        raise TensorShardConfigError(
            f"{where} with {given}: MoE with tensor or sequence parallelism is not supported by ds_tensorshard "
            "(only data and expert parallelism); initialize without the mpu or disable "
            f"'{BLOCK}.enabled'"
        )
    if offload_device(offload_block(zero, "offload_optimizer")) is not None:
        raise TensorShardConfigError(
            f"{where} with 'zero_optimization.offload_optimizer': MoE with ZeRO-Offload is not supported by "
            "ds_tensorshard; remove the block or disable "
            f"'{BLOCK}.enabled'"
        )
    if not truthy(zero.get("reduce_scatter", True)):
        raise TensorShardConfigError(  # stock ZeRO-1/2 asserts it (_configure_moe_settings)
            f"{where} with 'zero_optimization.reduce_scatter' false: stock ZeRO-1/2 requires it true for MoE; "
            "remove the key"
        )
    if zero.get("stage") == 2 and not truthy(zero.get("contiguous_gradients", True)):
        raise TensorShardConfigError(  # stock ZeRO-2 asserts it (_configure_moe_settings)
            f"{where} with 'zero_optimization.contiguous_gradients' false at stage 2: stock ZeRO-2 requires it "
            "true for MoE; remove the key"
        )
