"""The ``"tensorshard"`` config block and the checks a DeepSpeed config must pass to use it.

Everything here runs at the start of ``DeepSpeedEngine.__init__``, before the model is moved or any
optimizer state exists, and raises :class:`TensorShardConfigError` naming the offending key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ds_tensorshard.errors import TensorShardConfigError

BLOCK = "tensorshard"
ENV_SWITCH, ENV_CONFIG = "DS_TENSORSHARD", "DS_TENSORSHARD_CONFIG"  # turn the plugin on for configs built in code
DEFAULT_BUCKET_NUMEL = 4_000_000  # elements: small enough that two buckets in flight cost little memory


class TensorShardConfig(BaseModel):
    """Keys of the top-level ``"tensorshard"`` block."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Turn tensor-granular sharding on. Off: DeepSpeed runs exactly as stock."""

    comm_backend: Literal["torch", "mpi"] = "torch"
    """Transport for the plugin's collectives: ``"torch"`` = ``deepspeed.comm`` (gloo on CPU, NCCL on GPU);
    ``"mpi"`` = mpi4py. Both move each owner's part of a bucket with one reduce to the owner and one broadcast
    from it: nothing is padded."""

    split_tensors: Literal["auto", "never"] = "auto"
    """``"auto"``: a tensor too large to fit whole within a rank's share (the whole-tensor plan's fullest
    rank above 1.02x the ideal) is owned in dim-0 blocks, each by one rank, only as many as needed;
    ``"never"``: every tensor is owned whole (the best whole-tensor balance)."""

    timeout_s: float = Field(default=1800.0, gt=0)
    """Deadline, in seconds, of each of the plugin's own collectives (a wait, not the whole step). When it
    passes, every rank that waits raises an error naming the step, the bucket and its first tensor, the
    transport and the ranks that have not arrived; under MPI the job is aborted so that mpiexec returns.
    The default is torch.distributed's own default timeout."""

    bucket_numel: int | None = Field(default=None, gt=0)
    """Elements per communication bucket (the largest flat buffer; a large tensor travels in pieces);
    ``null`` takes ``zero_optimization.reduce_bucket_size`` where the config sets it, else 4,000,000."""


def parse_block(param_dict: Mapping[str, Any]) -> TensorShardConfig:
    """Parse and validate the ``tensorshard`` block of a DeepSpeed config dict, or, where the config has none,
    what the environment switch asks for: ``DS_TENSORSHARD=1`` with the keys in ``DS_TENSORSHARD_CONFIG``."""
    raw, where = _requested_block(param_dict)
    if not isinstance(raw, Mapping):
        raise TensorShardConfigError(f"'{where}' must be a JSON object, got {type(raw).__name__}")
    try:
        return TensorShardConfig(**raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in (where, *first["loc"]))
        if first["type"] == "extra_forbidden":
            known = ", ".join(TensorShardConfig.model_fields)
            raise TensorShardConfigError(f"unknown key '{key}' (known keys: {known})") from None
        raise TensorShardConfigError(
            f"invalid value for '{key}': {first['msg']} (got {first.get('input')!r})"
        ) from None


def from_environment(param_dict: Mapping[str, Any]) -> bool:
    """Whether the plugin is on through ``DS_TENSORSHARD=1`` rather than the config's own block."""
    if BLOCK in param_dict:
        return False
    switch = os.environ.get(ENV_SWITCH, "0")
    if switch not in ("0", "1"):
        raise TensorShardConfigError(f"environment variable {ENV_SWITCH}={switch!r}: use 1 (on) or 0 (off)")
    return switch == "1"


def _requested_block(param_dict: Mapping[str, Any]) -> tuple[Any, str]:
    if not from_environment(param_dict):
        return param_dict.get(BLOCK, {}), BLOCK
    try:
        keys = json.loads(os.environ.get(ENV_CONFIG) or "{}")
    except json.JSONDecodeError as err:
        raise TensorShardConfigError(f"environment variable {ENV_CONFIG} is not valid JSON: {err}") from None
    return ({"enabled": True, **keys} if isinstance(keys, Mapping) else keys), ENV_CONFIG


def _offload_device(block: Any) -> str | None:
    if isinstance(block, Mapping):
        device = block.get("device", "none")
        return None if device in (None, "none") else str(device)
    return None


def validate_engine_config(param_dict: Mapping[str, Any], client_optimizer: Any = None) -> TensorShardConfig | None:
    """Check a whole DeepSpeed config for ds_tensorshard; ``None`` when the plugin is not enabled or the engine
    has no ZeRO-1/2 optimizer to replace (stage 0, no optimizer; stage 3 only under the environment switch)."""
    config = parse_block(param_dict)
    if not config.enabled:
        return None
    zero = param_dict.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage == 0 or (stage == 3 and from_environment(param_dict)):
        _runs_as_stock(f"'zero_optimization.stage' {stage}")
        return None
    if stage not in (1, 2):
        raise TensorShardConfigError(
            f"'{BLOCK}.enabled' needs 'zero_optimization.stage' 1 (reduce at the accumulation boundary) or 2 "
            f"(reduce every micro-step); got stage {stage!r}"
            + (". ZeRO-3 splits tensors, which tensor-granular sharding replaces" if stage == 3 else "")
        )
    for key in ("offload_optimizer", "offload_param"):
        device = _offload_device(zero.get(key))
        if device is not None:
            raise TensorShardConfigError(
                f"'zero_optimization.{key}' (device {device!r}) is not supported with '{BLOCK}.enabled'; remove it"
            )
    if zero.get("cpu_offload"):
        raise TensorShardConfigError(f"'zero_optimization.cpu_offload' is not supported with '{BLOCK}.enabled'")
    compile_block = param_dict.get("compile")
    if isinstance(compile_block, Mapping) and compile_block.get("deepcompile"):
        raise TensorShardConfigError(
            f"'compile.deepcompile' is not supported with '{BLOCK}.enabled': DeepCompile's ZeRO-1/2 passes reduce "
            "into stock DeepSpeedZeroOptimizer's flat partitions; remove it (engine.compile() without DeepCompile, "
            "torch.compile of the module, is supported)"
        )
    if stage == 2 and zero.get("reduce_scatter", True):  # stock ZeRO-2 asserts these (stage_1_and_2.py)
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
    if (param_dict.get("fp16") or {}).get("enabled") is True:
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
    from ds_tensorshard.datapath.inner_optimizer import REFUSED, REFUSED_TYPES, check_supported

    if client_optimizer is None:
        opt_type = (param_dict.get("optimizer") or {}).get("type")
        if opt_type is None:
            _runs_as_stock("no optimizer (no 'optimizer' block, none given to deepspeed.initialize)")
            return None
        refused = REFUSED_TYPES.get(str(opt_type).lower())
        if refused is not None:
            raise TensorShardConfigError(
                f"'optimizer.type' {opt_type!r} cannot be sharded by ds_tensorshard: {REFUSED[refused]}"
            )
    elif isinstance(client_optimizer, torch.optim.Optimizer):
        check_supported(client_optimizer)
    return config


def _runs_as_stock(why: str) -> None:
    """The engine has nothing for the plugin to replace: say so once, on rank 0, and leave it to stock."""
    from deepspeed.utils import log_dist

    log_dist(f"ds_tensorshard: {why}: no ZeRO-1/2 optimizer to replace, this engine runs as stock DeepSpeed", [0])


def validate_parallel_layout(model: Any, mpu: Any, param_dict: Mapping[str, Any]) -> None:
    """Refuse the parallel layouts ds_tensorshard does not support, naming them, before anything is built.

    Supported: data parallelism, tensor parallelism through an ``mpu`` (Megatron-style), pipeline
    parallelism (a ``PipelineModule``, ZeRO stage 1 as stock allows) and Ulysses sequence parallelism
    through an ``mpu``."""
    from deepspeed.pipe import PipelineModule

    stage = (param_dict.get("zero_optimization") or {}).get("stage", 0)
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
    autotp = (param_dict.get("tensor_parallel") or {}).get("autotp_size", 0)
    if autotp and autotp > 1:
        raise TensorShardConfigError(
            f"'tensor_parallel.autotp_size' {autotp} (DeepSpeed AutoTP) is not supported by "
            "ds_tensorshard; pass a Megatron-style mpu to deepspeed.initialize instead"
        )
    expert = next((name for name, p in model.named_parameters() if getattr(p, "allreduce", True) is False), None)
    if expert is not None:
        raise TensorShardConfigError(
            f"MoE expert parameter '{expert}' (allreduce=False): mixture-of-experts layers are not supported by "
            f"ds_tensorshard; disable '{BLOCK}.enabled' for this model"
        )


def bucket_numel(config: TensorShardConfig, param_dict: Mapping[str, Any]) -> int:
    """Elements per bucket: the plugin key, else a reduce_bucket_size the config sets, else our default."""
    if config.bucket_numel is not None:
        return config.bucket_numel
    size = (param_dict.get("zero_optimization", {}) or {}).get("reduce_bucket_size")
    return int(size) if isinstance(size, (int, float)) and size > 0 else DEFAULT_BUCKET_NUMEL


MAPPED_ZERO_KEYS = {
    "stage": "selects the mode: 1 = reduce at the accumulation boundary, 2 = reduce every micro-step",
    "reduce_bucket_size": "bucket size (elements) unless tensorshard.bucket_numel is set (default 4,000,000)",
    "reduce_scatter": "at stage 2, true divides gradients by the world size before the sum, as stock does",
}
IGNORED_ZERO_KEYS = {
    "allgather_bucket_size": "updated parameters are broadcast in the reduce buckets",
    "overlap_comm": "reductions always start from gradient hooks during backward",
    "contiguous_gradients": "buckets are packed contiguously anyway",
    "round_robin_gradients": "ownership comes from the balanced plan",
    "allgather_partitions": "each owner broadcasts its updated pieces, bucket by bucket",
}


def zero_key_treatment(key: str) -> str:
    """How ds_tensorshard treats a ``zero_optimization`` key."""
    if key in MAPPED_ZERO_KEYS:
        return f"used, {MAPPED_ZERO_KEYS[key]}"
    if key in IGNORED_ZERO_KEYS:
        return f"no effect, {IGNORED_ZERO_KEYS[key]}"
    return "no effect on ds_tensorshard"


def describe_zero_mapping(param_dict: Mapping[str, Any]) -> str:
    """One log line per zero_optimization key present: how ds_tensorshard treats it."""
    zero = param_dict.get("zero_optimization", {}) or {}
    return "; ".join(f"zero_optimization.{key}={zero[key]!r}: {zero_key_treatment(key)}" for key in sorted(zero))
