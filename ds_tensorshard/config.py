"""The ``"tensorshard"`` config block and the checks a DeepSpeed config must pass to use it.

Everything here runs at the start of ``DeepSpeedEngine.__init__``, before the model is moved or any
optimizer state exists, and raises :class:`TensorShardConfigError` naming the offending key.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ds_tensorshard.errors import RefusedAsStock, TensorShardConfigError
from ds_tensorshard.stage3_config import validate_stage3, validate_stage3_layout

BLOCK = "tensorshard"
ENV_SWITCH, ENV_CONFIG = "DS_TENSORSHARD", "DS_TENSORSHARD_CONFIG"  # turn the plugin on for configs built in code


class TensorShardConfig(BaseModel):
    """Keys of the top-level ``"tensorshard"`` block."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Turn tensor-granular sharding on. Off: DeepSpeed runs exactly as stock."""

    comm_backend: Literal["torch", "mpi"] = "torch"
    """Transport for the plugin's collectives: ``"torch"`` = ``deepspeed.comm`` (gloo on CPU, NCCL on GPU);
    ``"mpi"`` = mpi4py. A window moves with one reduce-scatter of the owners' parts and one broadcast from each
    owner on mpi, one reduce to and one broadcast from each owner on torch: nothing is padded."""

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
    ``null`` takes ``zero_optimization.reduce_bucket_size`` where the config sets it, else the size chosen with the
    layout (``"auto"``: see ``bucket_layout``; an explicit layout: 4,000,000, or the cost model's for stripes and
    flat on accelerators)."""

    bucket_layout: Literal["auto", "windows", "stripes", "flat"] = "auto"
    """``"windows"``: a bucket is ``bucket_numel`` consecutive elements of the gradient stream, moved by owner
    (as ``comm_backend`` says); ``"stripes"``: bucket ``k`` holds the ``k``-th ``bucket_numel / n`` elements of
    every rank's owned tensors, each rank's in its slot (padded to the fullest), and moves with one
    reduce-scatter and one all-gather (or all-reduces where faster) whatever the world size; ``"flat"``: the
    tensors laid end to end in model order in one storage of n equal slots, rank ``r`` owning slot ``r`` (a
    tensor across a slot boundary split there), the parameters views of it: gradients reduced by stripes, the
    parameters gathered by one collective of the storage in place, as stock; ``"auto"``: on CPU ranks the layout
    measured faster there, in 4,000,000-element buckets (windows on torch/gloo; on mpi windows below 4 ranks,
    stripes from 4); on accelerators (NCCL and the like) flat where nothing in the run rules it out (ZeRO-Offload,
    MoE expert groups, whole-matrix optimizers, ``split_tensors: "never"``, pipeline or tensor parallelism,
    initialize_many), else stripes, sized by the cost model: the most buckets predicted within 0.9x stock
    ZeRO-2's communication at its defaults, each within its 5e8-element bucket; a bucket size the config sets is
    kept. Rank 0's start-up line says what was chosen and why."""


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
    """The device of an ``offload_*`` block: a string, or DeepSpeed's ``OffloadDeviceEnum`` (a str enum, whose
    ``str()`` is its name on Python 3.11, ``'OffloadDeviceEnum.cpu'``); None where nothing is offloaded."""
    if isinstance(block, Mapping):
        device = block.get("device", "none")
        device = getattr(device, "value", device)
        return None if device in (None, "none") else str(device)
    return None


# DeepSpeed's deprecated ZeRO flags and the key each one sets (DeepSpeedZeroConfig: true means device cpu, false none)
DEPRECATED_OFFLOAD = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}


def _offload_block(zero: Mapping[str, Any], key: str) -> Any:
    """``zero_optimization.<key>`` as stock reads it: its deprecated flag (``cpu_offload``, ``cpu_offload_param``),
    where set, stands for ``{"device": "cpu"}`` (true) or no block (false); DeepSpeed refuses both at once."""
    flag = zero.get(DEPRECATED_OFFLOAD[key])
    if flag is not None:
        return {"device": "cpu"} if _truthy(flag) else None
    return zero.get(key)


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
    _refuse_unfollowed_keys(param_dict, zero)
    # stock ZeRO-2 asserts these (stage_1_and_2.py), except under gradient_allreduce_op "sum", which ignores them
    if stage == 2 and zero.get("reduce_scatter", True) and not _sums_gradients(param_dict):
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
            _runs_as_stock("no optimizer (no 'optimizer' block, none given to deepspeed.initialize)")
            return None
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
    return config


def offloads_optimizer(param_dict: Mapping[str, Any]) -> bool:
    """Whether the config asks for ZeRO-Offload of the optimizer: ``zero_optimization.offload_optimizer`` with
    device cpu (each owner's fp32 masters and optimizer state in host memory)."""
    zero = param_dict.get("zero_optimization", {}) or {}
    return _offload_device(_offload_block(zero, "offload_optimizer")) == "cpu"


def _check_offload(zero: Mapping[str, Any]) -> None:
    """``offload_optimizer`` device cpu (or the deprecated ``cpu_offload: true``, as stock reads it) is followed;
    NVMe and ``offload_param`` are refused, naming the key."""
    device = optimizer_device = _offload_device(_offload_block(zero, "offload_optimizer"))
    if device not in (None, "cpu"):
        raise TensorShardConfigError(
            f"'zero_optimization.offload_optimizer' device {device!r} is not supported with '{BLOCK}.enabled': "
            "stock ZeRO-1/2 has no NVMe optimizer offload either (DeepSpeed swaps optimizer state to NVMe at "
            'ZeRO stage 3 only); use {"device": "cpu"}'
        )
    device = _offload_device(_offload_block(zero, "offload_param"))
    if device is not None:
        key = "cpu_offload_param" if zero.get("cpu_offload_param") is not None else "offload_param"
        raise TensorShardConfigError(
            f"'zero_optimization.{key}' (device {device!r}) is not supported with '{BLOCK}.enabled': "
            "parameter offload is a ZeRO stage 3 feature (ZeRO-1/2 keep every parameter on the accelerator); "
            "remove it"
        )
    if (
        optimizer_device == "cpu"
        and not _truthy(zero.get("compute_grad_norm", True))
        and _reads(COMPUTE_GRAD_NORM_RELEASE)
    ):
        raise TensorShardConfigError(  # stock ZeRO-1/2's constructor raises it too (0.19.7)
            "'zero_optimization.compute_grad_norm' false is not supported with 'zero_optimization.offload_optimizer' "
            "(stock DeepSpeed refuses it too); remove one of them"
        )


STOCK_ALIGNMENT = 2  # stock ZeRO-1/2's nccl_start_alignment_factor: 4-byte all-gather buffers of 2-byte elements


def _refuse_as_stock(zero: Mapping[str, Any]) -> None:
    """What stock ZeRO-1/2's constructor asserts about its own keys, refused with stock's message."""
    size = zero.get("allgather_bucket_size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and int(size) % STOCK_ALIGNMENT != 0:
        raise RefusedAsStock(
            f"'zero_optimization.allgather_bucket_size' {size!r}: allgather_bucket_size must be a multiple of "
            f"nccl_start_alignment_factor, {STOCK_ALIGNMENT} (stock DeepSpeed's ZeRO-1/2 refuses it too, though "
            "ds_tensorshard does not use the key); use an even number"
        )


def _truthy(value: Any) -> bool:
    """A config flag as DeepSpeed's pydantic models read it ("false", "0", "no" ... are false)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "f", "no", "n", "off")
    return bool(value)


def _block(param_dict: Mapping[str, Any], *names: str) -> Mapping[str, Any]:
    """The first of ``names`` that the config has as an object (DeepSpeed's current name first), else {}."""
    for name in names:
        value = param_dict.get(name)
        if isinstance(value, Mapping):
            return value
    return {}


def _reads(release: tuple[int, ...]) -> bool:
    """Whether the installed DeepSpeed reads a key its ``release`` added (an older one ignores it, as we do)."""
    from ds_tensorshard.versions import installed_release

    return installed_release() >= release


def _sums_gradients(param_dict: Mapping[str, Any]) -> bool:
    """``gradient_allreduce_op: "sum"`` (DeepSpeed 0.19.6): gradients are summed over data-parallel ranks, not
    averaged; ds_tensorshard follows it through ``engine.gradient_average``, as stock ZeRO-1/2 does."""
    op = str(param_dict.get("gradient_allreduce_op", "mean")).lower()
    return op == "sum" and _reads(GRADIENT_ALLREDUCE_OP_RELEASE)


GRADIENT_ALLREDUCE_OP_RELEASE = (0, 19, 6)
COMPUTE_GRAD_NORM_RELEASE = (0, 19, 7)  # zero_optimization.compute_grad_norm
AUTOCAST_RELEASE = (0, 17, 2)  # the torch_autocast block
AUTOCAST_WITHOUT_BF16_SCALER = (0, 17, 6)  # before it, stock ZeRO scales bf16 autocast gradients with a GradScaler
# (key, the release that added it, where its value is, the reason and what to do): refused when set (true, or any
# value for a block), on the releases that read it. Each changes how gradients are reduced or stepped, or where
# optimizer state lives, in a way ds_tensorshard does not follow (docs/configuration.md, "DeepSpeed 0.17-0.19 keys").
UNFOLLOWED_KEYS: tuple[tuple[str, tuple[int, ...], Callable[[Mapping[str, Any], Mapping[str, Any]], Any], str], ...] = (
    (
        "fp16.fp16_master_weights_and_grads",
        (0, 16, 0),
        lambda config, zero: _block(config, "fp16").get("fp16_master_weights_and_grads"),
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
        lambda config, zero: _block(config, "compile").get("deepcompile"),
        "DeepCompile's compiled passes reduce gradients into stock ZeRO's partitions themselves; remove it (or set "
        "it false), or disable 'tensorshard.enabled'",
    ),
    (
        "checkpoint.use_node_local_storage",
        (0, 16, 0),
        lambda config, zero: _block(config, "checkpoint").get("use_node_local_storage"),
        "a ds_tensorshard save is committed (moved into place, 'latest' written) by rank 0 in one folder that "
        "every rank writes to; use storage that all nodes share and remove the key",
    ),
    (
        "expert_parallel.enabled",
        (0, 19, 2),
        lambda config, zero: _block(config, "expert_parallel").get("enabled"),
        "AutoEP replaces a model's MoE blocks with its own expert-parallel layers inside the engine; ds_tensorshard "
        "supports deepspeed.moe.layer.MoE, but AutoEP has not been checked against stock (stock's AutoEP does not "
        "initialize on this project's CPU test machines); disable 'tensorshard.enabled' for this model",
    ),
)


def _refuse_unfollowed_keys(param_dict: Mapping[str, Any], zero: Mapping[str, Any]) -> None:
    """Refuse the keys (most of them added in DeepSpeed 0.17-0.19) whose effect on gradients, their reduction or
    the optimizer ds_tensorshard does not reproduce; each only on the releases that read it."""
    for key, release, value_of, what in UNFOLLOWED_KEYS:
        value = value_of(param_dict, zero)
        if _truthy(value) and _reads(release):
            shown = "" if value is True else f" ({value!r})"
            raise TensorShardConfigError(f"'{key}'{shown} is not supported with '{BLOCK}.enabled': {what}")
    if not _truthy(zero.get("compute_grad_norm", True)) and float(param_dict.get("gradient_clipping") or 0.0) > 0.0:
        raise TensorShardConfigError(  # stock ZeRO-1/2's constructor raises it (0.19.7); ds_tensorshard replaces it
            "'zero_optimization.compute_grad_norm' false needs 'gradient_clipping' 0 (stock DeepSpeed refuses "
            "clipping without a norm too); remove one of them"
        )
    bf16_fp32_accum = _truthy(_block(param_dict, "bf16", "bfloat16").get("enabled", False)) and str(
        _block(param_dict, "data_types").get("grad_accum_dtype")
    ).lower() in ("fp32", "float32", "float", "torch.float32")
    if zero.get("stage") == 1 and bf16_fp32_accum and not _truthy(zero.get("compute_grad_norm", True)):
        # stock raises it in _do_optimizer_sanity_check (0.19.7), which ds_tensorshard replaces for this route
        raise TensorShardConfigError(
            "'zero_optimization.compute_grad_norm' false is not supported with ZeRO stage 1, bf16 and "
            "'data_types.grad_accum_dtype' fp32 (stock DeepSpeed refuses it too); remove it or accumulate in bf16"
        )
    autocast = _block(param_dict, "torch_autocast")
    if _truthy(autocast.get("enabled", False)) and _reads(AUTOCAST_RELEASE):
        _check_autocast(autocast)


def _check_autocast(autocast: Mapping[str, Any]) -> None:
    """``torch_autocast`` (DeepSpeed 0.17.2): followed with dtype bf16 from 0.17.6 on, where stock ZeRO-1/2 sends
    the gradients of the tensors DeepSpeed marks (Linear and Conv weights by default) in bf16 and uses no
    GradScaler; refused otherwise."""
    from deepspeed.runtime.config import DtypeEnum

    from ds_tensorshard.versions import installed_release

    if not _reads(AUTOCAST_WITHOUT_BF16_SCALER):
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


def elastic_store_warning(env: Mapping[str, str]) -> str | None:
    """The line to warn with where torchrun may restart these workers (``--max-restarts`` above 0) with the
    rendezvous's shared TCPStore (torch's default) and their process group was made in it, before the plugin was
    imported (``transports.elastic_store`` gives each round a store of its own otherwise): the restarted process
    group's keys are the same as the dead one's, still in that store, so a rank can read a dead rank's gloo
    address and retry it until the process group's timeout (``Gloo connectFullMesh failed ... Connection
    refused``). None where torchrun does not restart with that store."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    return (
        "ds_tensorshard: torchrun may restart these workers with the store of the previous round (the rendezvous's "
        "shared TCPStore), and the process group was made before ds_tensorshard was imported: a restarted process "
        "group can read a dead rank's address from it and fail after its timeout ('Gloo connectFullMesh failed ... "
        "Connection refused'); import ds_tensorshard before the process group is made (or run the script with "
        "python -m ds_tensorshard), or start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store each "
        "round; docs/cluster.md, Elastic training)"
    )


def _runs_as_stock(why: str) -> None:
    """The engine has nothing for the plugin to replace: say so once, on rank 0, and leave it to stock (as a
    warning: DeepSpeed's logger shows nothing below it until the engine applies the config's ``log_level``)."""
    from deepspeed.utils import log_dist

    message = f"ds_tensorshard: {why}: no ZeRO-1/2 optimizer to replace, this engine runs as stock DeepSpeed"
    log_dist(message, [0], level=logging.WARNING)


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
    if _offload_device(_offload_block(zero, "offload_optimizer")) is not None:
        raise TensorShardConfigError(
            f"{where} with 'zero_optimization.offload_optimizer': MoE with ZeRO-Offload is not supported by "
            "ds_tensorshard; remove the block or disable "
            f"'{BLOCK}.enabled'"
        )
    if not _truthy(zero.get("reduce_scatter", True)):
        raise TensorShardConfigError(  # stock ZeRO-1/2 asserts it (_configure_moe_settings)
            f"{where} with 'zero_optimization.reduce_scatter' false: stock ZeRO-1/2 requires it true for MoE; "
            "remove the key"
        )
    if zero.get("stage") == 2 and not _truthy(zero.get("contiguous_gradients", True)):
        raise TensorShardConfigError(  # stock ZeRO-2 asserts it (_configure_moe_settings)
            f"{where} with 'zero_optimization.contiguous_gradients' false at stage 2: stock ZeRO-2 requires it "
            "true for MoE; remove the key"
        )


MAPPED_ZERO_KEYS = {
    "stage": "selects the mode: 1 = reduce at the accumulation boundary, 2 = reduce every micro-step",
    "reduce_bucket_size": "bucket size (elements) unless tensorshard.bucket_numel is set (else chosen with "
    "bucket_layout 'auto')",
    "reduce_scatter": "at stage 2, true divides gradients by the world size before the sum, as stock does",
    "offload_optimizer": "device cpu: each owner's fp32 masters and optimizer state in host memory (pinned with "
    "pin_memory where there is a GPU); the inner optimizer is stock's CPU one",
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
