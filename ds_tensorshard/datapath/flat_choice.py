"""Whether a run lays its dense parameters flat (``bucket_layout: "flat"``, :mod:`.flat_parameters`): asked for,
or by ``"auto"`` at more than one rank on accelerators or on CPU ranks of one host (the shared-memory lane), where
nothing in the run keeps it from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_tensorshard.datapath.flat_parameters import shared_lane
from ds_tensorshard.datapath.inner_optimizer import whole_matrix_params
from ds_tensorshard.errors import TensorShardConfigError
from ds_tensorshard.transports.protocol import Transport

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_tensorshard.config.schema import TensorShardConfig


def flat_refusal(
    engine: DeepSpeedEngine,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    expert_groups: bool,
    joint: bool,
    split_tensors: str,
) -> str | None:
    """What in the run keeps its parameters from a flat plan, in words; None where nothing does. A flat plan
    splits whichever tensors lie across a slot boundary, and its storage is one dtype on one device."""
    if joint:
        return "initialize_many (one plan for several models)"
    if engine.zero_cpu_offload():
        return "ZeRO-Offload (zero_optimization.offload_optimizer)"
    if expert_groups:
        return "a mixture-of-experts model (its experts stay whole in their expert groups)"
    if whole_matrix_params(optimizer):
        return f"the {type(optimizer).__name__} optimizer, which updates whole matrices"
    if split_tensors == "never":
        return "'tensorshard.split_tensors': 'never'"
    if isinstance(engine, PipelineEngine) or engine.mpu is not None:
        return "pipeline or tensor parallelism (an mpu)"
    if len({(p.dtype, p.device) for p in params}) > 1:
        return "trained parameters of more than one dtype or device"
    return None


def flat_wanted(
    engine: DeepSpeedEngine,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    expert_groups: bool,
    joint: object | None,
    config: TensorShardConfig,
) -> Callable[[Transport], bool]:
    """Whether this engine's dense parameters are laid flat, given the transport of its data-parallel group
    (:func:`lays_flat` of what :func:`flat_refusal` finds; shared memory where the lane is taken with room in
    /dev/shm for the parameters)."""
    refusal = flat_refusal(engine, optimizer, params, expert_groups, joint is not None, config.split_tensors)
    on_cpu, nbytes = engine.device.type == "cpu", sum(p.numel() * p.element_size() for p in params)

    def wanted(comm: Transport) -> bool:
        shares = on_cpu and config.bucket_layout == "auto" and shared_lane(comm, nbytes) is not None
        return lays_flat(config, on_cpu, comm.world_size, refusal, shares)

    return wanted


def lays_flat(
    config: TensorShardConfig, on_cpu: bool, world_size: int, refusal: str | None, shared_memory: bool = False
) -> bool:
    """``bucket_layout: "flat"`` (refused, naming why, where ``refusal`` says something keeps the run from it); or
    ``"auto"`` at more than one rank where nothing does, on an accelerator or on CPU ranks that share memory
    (``shared_memory``: the lane is taken, so the storage is shared and its gather a barrier). Other CPU ranks keep
    the layouts measured there (:func:`~ds_tensorshard.datapath.defaults.measured_on_cpu`)."""
    if config.bucket_layout == "flat":
        if refusal is not None:
            raise TensorShardConfigError(
                f"'tensorshard.bucket_layout': 'flat' with {refusal} is not supported; use 'stripes' or 'windows'"
            )
        return True
    return config.bucket_layout == "auto" and (shared_memory or not on_cpu) and world_size > 1 and refusal is None
