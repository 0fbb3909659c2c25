"""The global gradient norm, the overflow check and the unscale-and-clip divisor, as stock ZeRO-1/2 (and 3).

Per param group an fp64 sum of squares of the owned gradients (:meth:`OwnedShard.squared_grad_norms`), cast
to fp32 (kept fp64 at stage 3, as stock ZeRO-3) and summed over the ranks (:func:`sum_over_ranks`, which also
checks that every rank is at the same step); then :func:`global_norm` and :func:`decide` are pure arithmetic:
the groups' norms combined in that dtype, an invalid group norm makes the whole norm invalid (an overflow,
unless bf16 is not checked), and the gradients are unscaled and clipped with the loss scale *after* its
update, as stock does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScalerBase
from deepspeed.runtime.utils import is_model_parallel_parameter

from ds_tensorshard.errors import StepMismatch
from ds_tensorshard.transports.deadline import wait_or_fail
from ds_tensorshard.transports.protocol import Transport

STEP_CHECK_MODULUS = 4096  # the step check sums steps modulo this: exact in fp32 up to 4,096 ranks


def loss_scaler_of(engine: Any, dtype: torch.dtype) -> LossScalerBase:
    """The engine's loss scaler (static, or dynamic for fp16), as stock ZeRO-1/2 builds it."""
    return CreateLossScaler(
        dtype=dtype,
        static_loss_scale=engine.loss_scale(),
        dynamic_scaling=engine.dynamic_loss_scale(),
        dynamic_loss_args=engine.dynamic_loss_scale_args(),
    )


def counted_in_norm(param: torch.nn.Parameter, model_parallel_rank: int) -> bool:
    """Stock's model-parallel rule: each tensor-parallel shard once, a replicated tensor on model-parallel
    rank 0 only, a pipeline-replicated (tied) copy not at all."""
    if getattr(param, PIPE_REPLICATED, False):
        return False
    return is_model_parallel_parameter(param) or model_parallel_rank == 0


def sum_over_ranks(
    squares: torch.Tensor,
    step: int,
    comm: Transport,
    model_parallel_group: Any,
    describe: Callable[[], str],
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, steps)``: each group's sum of squares (fp64, this rank's) summed over the data-parallel ranks
    in ``dtype`` (fp32 as stock ZeRO-1/2, fp64 as stock ZeRO-3), then over the tensor-parallel shards; and the
    ranks' steps (mod :data:`STEP_CHECK_MODULUS`) summed, for :func:`check_steps`. Both stay on the device: the
    host reads what it needs once (:func:`read_on_host`)."""
    count = torch.tensor([float(step % STEP_CHECK_MODULUS)], dtype=dtype, device=squares.device)
    stats = torch.cat([squares.to(dtype), count])
    wait_or_fail(lambda: comm.all_reduce_sum(stats, describe), comm, describe)
    partials, steps = stats[:-1].clone(), stats[-1]
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        dist.all_reduce(partials, group=model_parallel_group)  # tensor-parallel shards add up, as stock
    return partials, steps


def check_steps(summed: float, step: int, comm: Transport) -> None:
    """Every rank is at ``step``, or :class:`~ds_tensorshard.errors.StepMismatch` on every rank."""
    if summed != comm.world_size * (step % STEP_CHECK_MODULUS):
        raise StepMismatch(
            f"ds_tensorshard: the ranks of the data-parallel group are at different optimizer steps: this rank "
            f"(rank {comm.rank}) is at step {step}, but their steps (mod {STEP_CHECK_MODULUS}) sum to "
            f"{summed:.0f}, not {comm.world_size} x {step % STEP_CHECK_MODULUS}; a rank skipped or repeated "
            "a step (its data ran out?)"
        )


def read_on_host(steps: torch.Tensor, norm: torch.Tensor, invalid: torch.Tensor, scale: float) -> tuple:
    """``(steps, norm / scale, invalid)`` as Python values, in one device-to-host read: the step's one host
    sync (the decision to skip, the reported norm and the step check need them)."""
    summed, unscaled, bad = torch.stack([steps.double(), (norm / scale).double(), invalid.double()]).tolist()
    return summed, unscaled, bool(bad)


def expert_norm_averaging(
    experts: list[tuple[int, Transport]], describe: Callable[[], str]
) -> Callable[[torch.Tensor], None]:
    """Stock's rule for MoE param groups (``_average_expert_grad_norms``): each expert group's norm, already
    summed over the whole data-parallel group, is divided by its expert-data-parallel group's size and summed
    over that group. ``experts``: (param group index, that group's expert transport)."""

    def average(group_norms: torch.Tensor) -> None:
        for index, comm in experts:
            scaled = group_norms[index : index + 1] / comm.world_size
            wait_or_fail(functools.partial(comm.all_reduce_sum, scaled, describe), comm, describe)
            group_norms[index] = scaled[0]

    return average


def global_norm(
    partials: torch.Tensor, average_experts: Callable[[torch.Tensor], None] = lambda norms: None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, invalid)`` from the groups' summed squares, on the device: the groups' norms (expert groups'
    averaged by ``average_experts``) combined in fp32; inf, and invalid, where any group's norm is inf or nan."""
    group_norms = partials.pow(1.0 / 2)
    average_experts(group_norms)
    invalid = (~torch.isfinite(group_norms)).any()
    return torch.where(invalid, float("inf"), torch.linalg.vector_norm(group_norms)), invalid


def norm_over_ranks(
    squares: torch.Tensor,
    step: int,
    scale: float,
    comm: Transport,
    model_parallel_group: Any,
    experts: list[tuple[int, Transport]],
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, float, bool]:
    """``(norm, norm / scale, invalid)``: each group's ``squares`` (this rank's) summed over the ranks
    (:func:`sum_over_ranks`), the global norm (:func:`global_norm`; ``experts``: each expert group's param group
    index and transport, for :func:`expert_norm_averaging`), the norm on the device and the rest read on the host
    in the step's one host sync (:func:`read_on_host`); every rank checked to be at ``step`` (:func:`check_steps`)."""
    describe = lambda: f"step {step}, global norm all-reduce"  # noqa: E731
    partials, steps = sum_over_ranks(squares, step, comm, model_parallel_group, describe, dtype)
    norm, invalid = global_norm(partials, expert_norm_averaging(experts, describe))
    summed, unscaled, bad = read_on_host(steps, norm, invalid, scale)
    check_steps(summed, step, comm)
    return norm, unscaled, bad


@dataclass(frozen=True)
class NormRules:
    """How an engine's config and DeepSpeed release treat the norm (read once, at initialize)."""

    clip: float  # gradient_clipping; 0: none
    compute_norm: bool  # zero_optimization.compute_grad_norm (DeepSpeed before 0.19.7 always computes it)
    checks_overflow: bool  # fp16/fp32 always; bf16 only with bf16.check_grad_overflow (never through 0.17.0)
    overflow_norm_is_inf: bool  # after an overflow get_global_grad_norm() is inf (0.19.8), else the last norm
    stage3: bool = False  # stock ZeRO-3: reports the norm (a tensor) over the loss scale after its update
    sum_dtype: torch.dtype = torch.float32  # the ranks' sums added in: fp64 at stage 3 but with ZeRO-Offload

    @classmethod
    def of(cls, engine: Any, release: tuple[int, ...]) -> NormRules:
        if engine.zero_optimization_partition_weights():  # stock ZeRO-3: an invalid norm always skips the step
            offloaded = engine.zero_cpu_offload()  # stock ZeRO-3 then adds the ranks' sums in fp32, as ZeRO-1/2
            dtype = torch.float32 if offloaded else torch.float64
            return cls(float(engine.gradient_clipping()), True, True, True, stage3=True, sum_dtype=dtype)
        bf16 = getattr(engine._config, "bfloat16_config", None)
        return cls(
            clip=float(engine.gradient_clipping()),
            compute_norm=getattr(engine, "zero_compute_grad_norm", lambda: True)(),
            checks_overflow=engine.get_data_types()[0] != torch.bfloat16
            or (engine.bfloat16_enabled() and bf16 is not None and bf16.check_grad_overflow),
            overflow_norm_is_inf=release >= (0, 19, 8),
        )


@dataclass(frozen=True)
class Decision:
    """What a step does with its gradients: skip them (overflow) or divide them by ``divisor`` (None: as
    they are); ``reported`` is what ``engine.get_global_grad_norm()`` gives afterwards."""

    overflow: bool
    divisor: float | torch.Tensor | None
    reported: float | torch.Tensor | None


def decide(
    norm: torch.Tensor,
    unscaled: float,
    overflow: bool,
    scale_before: float,
    scale_after: float,
    rules: NormRules,
    previous: float | torch.Tensor | None,
) -> Decision:
    """The step's decision from the (loss-scaled) global ``norm`` (on the device; ``unscaled``: ``norm /
    scale_before`` read on the host) and the loss scale before and after its update; ``previous``: the last
    step's reported norm."""
    reported: float | torch.Tensor | None
    if overflow:
        reported = None if not rules.compute_norm else float("inf") if rules.overflow_norm_is_inf else previous
        return Decision(overflow=True, divisor=None, reported=reported)
    reported = unscaled if rules.compute_norm else None
    if rules.stage3:
        reported = norm / scale_after  # stock ZeRO-3's: a tensor, over the loss scale after its update
    if rules.clip == 0.0 and scale_after == 1.0:
        return Decision(overflow=False, divisor=None, reported=reported)
    divisor: float | torch.Tensor = scale_after
    if rules.clip > 0.0 and rules.compute_norm:
        divisor = torch.clamp(((norm / scale_after) + 1e-6) / rules.clip, min=1.0) * scale_after
    return Decision(overflow=False, divisor=divisor, reported=reported)
