"""TensorShardOptimizer: the ZeRO-1/2 replacement that DeepSpeed's unmodified engine drives.

Data path, one file per step: :mod:`.plan` (tensors -> balanced sets, each tensor owned whole or,
if it cannot fit, in dim-0 blocks) -> :mod:`.buckets` (bounded windows of the gradient stream,
grouped by owner) -> :mod:`.reduce` (mean onto the owner, one reduce per owner in a bucket) ->
:mod:`.update` (the inner optimizer on owned fp32 masters) -> :mod:`.gather` (owners broadcast
updated pieces back).

Example (one process; with more ranks every rank runs the same lines)::

    import deepspeed, torch, ds_tensorshard
    model = torch.nn.Linear(8, 8)
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "tensorshard": {"enabled": True}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config)
    assert isinstance(optimizer, ds_tensorshard.TensorShardOptimizer)
    print(optimizer.plan.numel_per_rank, optimizer.plan.owner(model.weight))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import logger
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from ds_tensorshard.checkpoints.rank_file import RankFile, loss_scaler_fields, restore_loss_scaler
from ds_tensorshard.checkpoints.sources import CheckpointSource
from ds_tensorshard.config import TensorShardConfig, bucket_numel, describe_zero_mapping
from ds_tensorshard.datapath.broadcast import Broadcast, broadcast_buckets
from ds_tensorshard.datapath.buckets import Bucket, build_buckets
from ds_tensorshard.datapath.inner_optimizer import (
    check_supported,
    keep_owned_state,
    newton_schulz_work,
    orthogonalized_params,
    step_value,
    whole_matrix_params,
)
from ds_tensorshard.datapath.plan import Block, OwnershipPlan, plan_ownership
from ds_tensorshard.datapath.reduce import Averaging, OverlappedReducer
from ds_tensorshard.datapath.update import OwnedShard
from ds_tensorshard.errors import CheckpointError, StepMismatch, TensorShardConfigError
from ds_tensorshard.transports.deadline import wait_or_fail
from ds_tensorshard.transports.protocol import Transport
from ds_tensorshard.transports.torch_comm import TorchComm
from ds_tensorshard.versions import installed_release

STEP_CHECK_MODULUS = 4096  # the step check sums steps modulo this: exact in fp32 up to 4,096 ranks
JOINT_PLAN_ATTRIBUTE = "_tensorshard_joint_plan"  # set on a model by initialize_many while its engine is built


@dataclass(frozen=True)
class Prepared:
    """What :meth:`TensorShardOptimizer.prepare_step` decided, for :meth:`~TensorShardOptimizer.step` to apply."""

    overflow: bool
    combined_scale: float | torch.Tensor | None  # the unscale-and-clip divisor; None: gradients stay as they are


@dataclass
class Overlap:
    """A step's state that reaches outside :meth:`TensorShardOptimizer.step`, where several models overlap
    (:func:`~ds_tensorshard.initialize_many`, :func:`~ds_tensorshard.step_many`)."""

    reduce_in_background: bool  # engines of initialize_many: the last reductions of a backward keep running
    defer_broadcast: bool = False  # set by step_many: step() starts the gathers, finish_broadcast() completes them
    pending_broadcast: Broadcast | None = None  # the gathers a deferred step started
    prepared: Prepared | None = None  # prepare_step() ran (step_many runs it for every engine first)


class TensorShardOptimizer(ZeROOptimizer):
    """Tensor-granular ZeRO-1/2: each parameter tensor is owned whole by one data-parallel rank.

    Built by the engine (through :func:`ds_tensorshard.install`) from the basic optimizer DeepSpeed
    made out of the ``optimizer`` block or the client optimizer. ``zero_optimization.stage`` 1
    reduces at the accumulation boundary; stage 2 reduces every micro-step and keeps only owned
    gradients. ``plan`` is the :class:`~ds_tensorshard.datapath.plan.OwnershipPlan`: ``joint_plan`` when the
    engine is one of :func:`~ds_tensorshard.initialize_many`'s, else one made for this model alone.
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        engine: DeepSpeedEngine,
        config: TensorShardConfig,
        joint_plan: OwnershipPlan | None = None,
    ) -> None:
        super().__init__()
        check_supported(init_optimizer)
        eager_state = len(init_optimizer.state) > 0  # e.g. Adagrad builds its state at construction
        self.optimizer = init_optimizer
        self.dp_process_group = engine.seq_data_parallel_group
        self.comm = _transport(config.comm_backend, self.dp_process_group, config.timeout_s)
        self._step_of = lambda: engine.global_steps
        self.partition_gradients = engine.zero_optimization_stage() == 2
        self.clip_grad = float(engine.gradient_clipping())
        self.dtype = engine.get_data_types()[0]
        bf16_config = getattr(engine._config, "bfloat16_config", None)  # through 0.17.0: bf16 is never checked
        self.check_grad_overflow = engine.fp16_enabled() or (
            engine.bfloat16_enabled() and bf16_config is not None and bf16_config.check_grad_overflow
        )
        # DeepSpeed before 0.19.7 has no compute_grad_norm setting: it always computes the norm
        self.compute_grad_norm = getattr(engine, "zero_compute_grad_norm", lambda: True)()
        # what get_global_grad_norm() gives after an overflow: inf since 0.19.8, the last step's norm before
        self.overflow_norm_is_inf = installed_release() >= (0, 19, 8)
        self.model_parallel_group = engine.mpu.get_model_parallel_group() if engine.mpu is not None else None
        self.model_parallel_rank = bwc_tensor_model_parallel_rank(engine.mpu)
        self._init_loss_scaling(engine)
        self.averaging = Averaging.like_deepspeed(engine, self.comm.world_size)
        self.overflow = False
        self._global_grad_norm: float | None = None

        # zero-element tensors have nothing to update: dropped, as stock ZeRO does
        self.bit16_groups = [
            [p for p in group["params"] if p.requires_grad and p.numel() > 0] for group in init_optimizer.param_groups
        ]
        self.round_robin_bit16_groups = self.bit16_groups
        self.params = _in_model_order(self.bit16_groups, engine.module)
        self.names = {p: engine.param_names[p] for p in self.params}
        whole = {self.names[p] for p in whole_matrix_params(init_optimizer) if p in self.names}
        work = {
            self.names[p]: newton_schulz_work(tuple(p.shape))
            for p in orthogonalized_params(init_optimizer)
            if p in self.names
        }
        self.plan = joint_plan or plan_ownership(
            ((self.names[p], tuple(p.shape)) for p in self.params),
            self.comm.world_size,
            param_names={id(p): name for p, name in self.names.items()},
            split=config.split_tensors,
            unsplittable=whole,
            work=work,
        )
        _check_plan_covers(self.plan, self.params, self.comm.world_size)
        _check_whole(self.plan, self.params, self.names, whole, type(init_optimizer).__name__)
        # an engine of initialize_many leaves its last reductions in flight after backward, to run
        # during the next model's backward; its step() (or zero_grad()) completes them
        self.overlap = Overlap(reduce_in_background=joint_plan is not None)
        self.checkpoint_id: str | None = None  # set by the engine's save_checkpoint before state_dict()
        rank = self.comm.rank
        owned = [
            [(p, b) for p in group for b in self.plan.blocks_of(p) if b.rank == rank] for group in self.bit16_groups
        ]
        accum_dtype = engine.get_data_types()[1]
        self.shard = OwnedShard(init_optimizer, owned, accum_dtype, engine.device)
        keep_owned_state(init_optimizer, self.shard.masters.values(), eager_state)
        # stage 1 with grad_accum_dtype wider than the model's: micro-step gradients are held in that dtype
        self.held: dict[torch.nn.Parameter, torch.Tensor] | None = (
            {} if not self.partition_gradients and accum_dtype != self.dtype else None
        )
        self._inside_no_sync = lambda: engine.inside_no_sync_ctxt
        # a PipelineEngine runs backward itself and reduces once, at the end of the batch (as stock ZeRO-1)
        self.pipeline = isinstance(engine, PipelineEngine)
        # the inner optimizer refuses new groups too
        init_optimizer.add_param_group = self.add_param_group  # type: ignore[method-assign]
        self.bucket_numel = bucket_numel(config, engine._config._param_dict)
        self.reducer = OverlappedReducer(
            self._build_buckets(list(reversed(self.params))),
            self.comm,
            self.averaging,
            self._deliver,
            self.params,
            self.names.__getitem__,
            self._build_buckets,
            self._gradient_of,
            self._release,
            self._step_of,
        )
        for param in self.params:  # a model given to a new engine drops the previous engine's hook
            previous = getattr(param, "_tensorshard_hook", None)
            if previous is not None:
                previous.remove()
            hook = param.register_post_accumulate_grad_hook(self._gradient_ready)
            param._tensorshard_hook = hook  # type: ignore[attr-defined]
        if engine.global_rank == 0:
            split = self.plan.split
            logger.info(
                f"ds_tensorshard: stage {engine.zero_optimization_stage()}, {len(self.params)} tensors "
                f"({len(split)} split into dim-0 blocks) in {len(self.buckets)} buckets of at most "
                f"{self.bucket_numel:,} elements (no padding), fullest rank / ideal {self.plan.imbalance:.4f}; "
                f"{describe_zero_mapping(engine._config._param_dict)}"
            )

    def _counted_in_norm(self, param: torch.nn.Parameter) -> bool:
        """Stock's model-parallel rule: each tensor-parallel shard once, a replicated tensor on model-parallel
        rank 0 only, a pipeline-replicated (tied) copy not at all."""
        if getattr(param, PIPE_REPLICATED, False):
            return False
        return is_model_parallel_parameter(param) or self.model_parallel_rank == 0

    def _init_loss_scaling(self, engine: DeepSpeedEngine) -> None:
        self.loss_scaler = CreateLossScaler(
            dtype=self.dtype,
            static_loss_scale=engine.loss_scale(),
            dynamic_scaling=engine.dynamic_loss_scale(),
            dynamic_loss_args=engine.dynamic_loss_scale_args(),
        )
        self.dynamic_loss_scale = isinstance(self.loss_scaler, DynamicLossScaler)
        self.custom_loss_scaler = False
        self.external_loss_scale = None
        self.torch_autocast_gradscaler = None

    def _build_buckets(self, backward_order: list[torch.nn.Parameter]) -> list[Bucket]:
        return build_buckets(backward_order, self.plan.blocks_of, self.bucket_numel)

    @property
    def buckets(self) -> list[Bucket]:
        """The communication buckets, in the order reductions start (backward's, once it has been seen)."""
        return self.reducer.buckets

    # -- what the engine reads ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    cur_scale = loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Engines before DeepSpeed 0.19 hand the backward to a ZeRO optimizer: as their stock ZeRO-1/2
        does, the loss in fp32 times the loss scale (1 unless fp16). Newer engines scale and run it themselves."""
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)

    # -- reduce ---------------------------------------------------------------------------------
    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        """Stage 1, at the accumulation boundary: average every gradient onto its owner."""
        self._reduce_to_owners()

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        """Stage 2, after every backward: average onto owners, who accumulate in fp32."""
        self._reduce_to_owners()

    def finalize_gradient_accumulation_boundary(self) -> None:
        """Stage 2 with caller-managed accumulation: every micro-step was already reduced; nothing is pending."""

    @torch.no_grad()
    def _reduce_to_owners(self) -> None:
        self.reducer.finish(wait=not self.overlap.reduce_in_background)

    @torch.no_grad()
    def _gradient_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: in a backward that reduces (stage 2: every one; stage 1: the
        boundary's, outside ``engine.no_sync()``), hand the gradient to the reducer, which starts
        complete buckets at once. Otherwise (stage 1) the gradient accumulates, in the model or held
        in ``grad_accum_dtype``."""
        reducing = self.partition_gradients or (
            self._at_boundary() and not self._inside_no_sync() and not self.pipeline
        )
        if self.held is not None and (param in self.held or not reducing):
            assert param.grad is not None, f"{self.names[param]}: hook called without a gradient"
            held = self.held.get(param)
            self.held[param] = param.grad.to(self.shard.accum_dtype) if held is None else held.add_(param.grad)
            param.grad = None
        if reducing:
            self.reducer.gradient_ready(param)

    def _at_boundary(self) -> bool:
        """The engine's accumulation boundary: a method with a setter since DeepSpeed 0.19.6, a plain
        attribute the engine assigns before that."""
        flag = self.is_gradient_accumulation_boundary
        return bool(flag() if callable(flag) else flag)

    def _gradient_of(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient to reduce: held in a wider dtype (stage 1 with grad_accum_dtype), else the model's."""
        held = self.held.get(param) if self.held is not None else None
        return param.grad if held is None else held

    def _release(self, param: torch.nn.Parameter) -> None:
        """A gradient is packed into its last bucket: the model no longer keeps it."""
        param.grad = None
        if self.held is not None:
            self.held.pop(param, None)

    def _deliver(self, bucket: Bucket, segment: torch.Tensor) -> None:
        owned = bucket.segment_of(self.comm.rank)
        assert owned is not None, "a segment is delivered only to its owner"
        for piece, grad in owned.views(segment):
            self.shard.accumulate(piece, grad)

    # -- update and gather ----------------------------------------------------------------------
    @torch.no_grad()
    def prepare_step(self) -> None:
        """The part of :meth:`step` that communicates before the update: complete the reductions,
        all-reduce the global norm, check overflow, update the loss scale. :func:`~ds_tensorshard.step_many`
        runs it for every engine first, so that each model's update overlaps the previous one's all-gathers.

        Numerics follow stock ZeRO-1/2 step for step: per param group an fp64 sum of squares, cast to
        fp32, summed over ranks, square-rooted; the groups' norms combined in fp32; an invalid norm is an
        overflow; the gradients are unscaled and clipped with the loss scale *after* its update."""
        self.reducer.drain()
        self.shard.gradients_to_masters()
        step = self._step_of()
        # one extra element: the ranks' steps (mod 4096, exact in fp32), summed with the norms
        stats = torch.cat(
            [
                self.shard.squared_grad_norms(self._counted_in_norm).float(),
                torch.tensor([float(step % STEP_CHECK_MODULUS)], device=self.shard.device),
            ]
        )
        wait_or_fail(lambda: self.comm.all_reduce_sum(stats), self.comm, lambda: f"step {step}, global norm all-reduce")
        partials, steps = stats[:-1].clone(), float(stats[-1])
        if steps != self.comm.world_size * (step % STEP_CHECK_MODULUS):
            raise StepMismatch(
                f"ds_tensorshard: the ranks of the data-parallel group are at different optimizer steps: this rank "
                f"(rank {self.comm.rank}) is at step {step}, but their steps (mod {STEP_CHECK_MODULUS}) sum to "
                f"{steps:.0f}, not {self.comm.world_size} x {step % STEP_CHECK_MODULUS}; a rank skipped or repeated "
                "a step (its data ran out?)"
            )
        if self.model_parallel_group is not None and dist.get_world_size(self.model_parallel_group) > 1:
            # tensor-parallel shards add up, as stock
            dist.all_reduce(partials, group=self.model_parallel_group)
        group_norms = partials.pow(1.0 / 2)
        invalid = bool((~torch.isfinite(group_norms)).any())  # a group's inf/nan makes the whole norm invalid
        scaled_norm = (
            torch.full((), float("inf"), device=partials.device) if invalid else torch.linalg.vector_norm(group_norms)
        )
        self.overflow = (self.dtype != torch.bfloat16 or self.check_grad_overflow) and invalid
        prev_scale = self.loss_scale
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            if not self.compute_grad_norm:
                self._global_grad_norm = None
            elif self.overflow_norm_is_inf:
                self._global_grad_norm = float("inf")
            self.overlap.prepared = Prepared(overflow=True, combined_scale=None)
            return
        self._global_grad_norm = float(scaled_norm / prev_scale) if self.compute_grad_norm else None
        if self.clip_grad == 0.0 and self.loss_scale == 1.0:
            self.overlap.prepared = Prepared(overflow=False, combined_scale=None)
            return
        combined_scale: float | torch.Tensor = self.loss_scale
        if self.clip_grad > 0.0 and self.compute_grad_norm:
            clip = ((scaled_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
        self.overlap.prepared = Prepared(overflow=False, combined_scale=combined_scale)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Global norm and overflow check, loss-scale update (:meth:`prepare_step`, unless already run),
        unscale + clip, Adam on owned tensors, gather."""
        if self.overlap.prepared is None:
            self.prepare_step()
        prepared, self.overlap.prepared = self.overlap.prepared, None
        assert prepared is not None
        if prepared.overflow:
            self.zero_grad()
            self.shard.drop_grads()
            return
        if prepared.combined_scale is not None:
            self.shard.scale_grads(1.0 / prepared.combined_scale)
        self.shard.step()
        self.shard.drop_grads()
        if self.overlap.defer_broadcast:
            self.overlap.pending_broadcast = Broadcast(self.buckets, self.comm, self.reducer.describe)
        else:
            broadcast_buckets(self.buckets, self.comm, self.reducer.describe)

    def finish_broadcast(self) -> None:
        """Complete the all-gathers a deferred step() started (see :func:`ds_tensorshard.step_many`)."""
        if self.overlap.pending_broadcast is not None:
            self.overlap.pending_broadcast.finish()
            self.overlap.pending_broadcast = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (to None, or to zeros with ``set_to_none=False``), as stock does; the
        owners' reduced gradients are the step's and are dropped by it."""
        self.reducer.drain()
        self.overlap.prepared = None
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()
        if self.held is not None:
            if set_to_none:
                self.held.clear()
            else:
                for held in self.held.values():
                    held.zero_()

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the ownership plan, buckets and hooks are built for the groups given at initialize."""
        raise TensorShardConfigError(
            "add_param_group is not supported by ds_tensorshard: ownership, buckets and gradient hooks are planned "
            "once, for the param groups given to deepspeed.initialize; pass every group there (a group may start "
            "with lr 0)"
        )

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's file (a :class:`~ds_tensorshard.checkpoints.rank_file.RankFile`): whole owned tensors keyed by
        name, plus what every rank shares."""
        tensors = {}
        for param, master in self.shard.masters.items():
            state = {k: _as_int(v) if k == "step" else v for k, v in self.optimizer.state.get(master, {}).items()}
            tensors[self.names[param]] = {"master": master, **state}
            if not self.shard.is_whole(param):
                block = self.shard.blocks[param]
                tensors[self.names[param]]["block"] = [block.start, block.stop]
        return RankFile(
            checkpoint_id=self.checkpoint_id,
            world_size=self.comm.world_size,
            rank=self.comm.rank,
            tensors=tensors,
            group_names=[[self.names[p] for p in group] for group in self.bit16_groups],
            shapes={self.names[p]: tuple(p.shape) for p in self.params},
            param_groups=[{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            loss_scaler=loss_scaler_fields(self.loss_scaler),
            overflow=self.overflow,
            clip_grad=self.clip_grad,
        ).to_dict()

    def expected_checkpoint_layout(self) -> tuple[list[list[str]], dict[str, tuple[int, ...]]]:
        """Param-group membership and shapes, by name, that a checkpoint must match."""
        return (
            [[self.names[p] for p in group] for group in self.bit16_groups],
            {self.names[p]: tuple(p.shape) for p in self.params},
        )

    @torch.no_grad()
    def load_from_source(self, source: CheckpointSource, load_optimizer_states: bool = True) -> None:
        """Take the owned tensors' masters (and moments, step, hyper-parameters, loss scale) from a checkpoint."""
        for param, master in self.shard.masters.items():
            saved = source.tensor(self.names[param])
            block = self.shard.blocks[param]
            master.copy_(_owned_part(saved.master, param, block, master))
            self.optimizer.state.pop(master, None)
            if load_optimizer_states and saved.state:
                state = {
                    k: _owned_part(v, param, block, master).to(master.device).contiguous() if torch.is_tensor(v) else v
                    for k, v in saved.state.items()
                    if k != "step"
                }
                if "step" in saved.state:
                    state["step"] = step_value(self.optimizer, master, saved.state["step"])
                self.optimizer.state[master] = state
        if load_optimizer_states:
            for group, saved_group in zip(self.optimizer.param_groups, source.param_groups):
                group.update(saved_group)
            if source.scaler is not None and source.scaler.loss_scaler:
                self.loss_scaler = restore_loss_scaler(source.scaler.loss_scaler, self.dtype)
                self.dynamic_loss_scale = isinstance(self.loss_scaler, DynamicLossScaler)
                self.overflow = source.scaler.overflow

    @torch.no_grad()
    def update_lp_params(self) -> None:
        """Write the masters into the model's tensors on every rank (after a universal-checkpoint load)."""
        for param, master in self.shard.masters.items():
            param.data.copy_(master)
        broadcast_buckets(self.buckets, self.comm)

    def load_state_dict(
        self,
        state_dict_list: Any = None,
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
        checkpoint_folder: Any = None,
        load_serial: Any = None,
        param_shapes: Any = None,
    ) -> None:
        raise CheckpointError(
            "ds_tensorshard loads checkpoints through engine.load_checkpoint(), which reads "
            "every rank's file by tensor name; the per-rank state_dict list is not used"
        )

    # -- weights loaded from outside (module-only loads, checkpoints without optimizer state) ----
    def _restore_from_bit16_weights(self) -> None:
        self.shard.reload_from_params()

    def refresh_fp32_params(self) -> None:
        self.shard.reload_from_params()


def _check_plan_covers(plan: OwnershipPlan, params: list, world_size: int) -> None:
    if plan.world_size != world_size:
        raise ValueError(
            f"the shared plan is for {plan.world_size} ranks but this engine's data-parallel group has {world_size}"
        )
    missing = next((p for p in params if id(p) not in plan.param_names), None)
    if missing is not None:
        raise ValueError(
            f"a trainable parameter of shape {tuple(missing.shape)} is not in the shared plan: "
            "initialize_many plans the models' named_parameters() that require grad"
        )


def _check_whole(plan: OwnershipPlan, params: list, names: dict, whole: set, optimizer: str) -> None:
    """A tensor the inner optimizer needs whole must not have been split (a joint plan is made without it)."""
    split = next((names[p] for p in params if names[p] in whole and len(plan.blocks_of(p)) > 1), None)
    if split is not None:
        raise TensorShardConfigError(
            f"tensor '{split}' is split in the shared plan, but {optimizer} updates whole matrices; give the models "
            "of initialize_many 'tensorshard.split_tensors': 'never'"
        )


def _owned_part(saved: torch.Tensor, param: torch.nn.Parameter, block: Block, master: torch.Tensor) -> torch.Tensor:
    """This rank's block of a saved tensor shaped like ``param``; other saved state (factors) as it is."""
    if saved.numel() != param.numel():
        return saved
    return saved.reshape(-1)[block.start : block.stop].view_as(master)


def _transport(backend: str, group: Any, timeout_s: float) -> Transport:
    if backend == "mpi":
        from ds_tensorshard.transports.mpi_comm import MpiComm

        return MpiComm(group, timeout_s)
    return TorchComm(group, timeout_s)


def _as_int(step: Any) -> int:
    return int(step.item()) if torch.is_tensor(step) else int(step)


def _in_model_order(groups: list[list[torch.nn.Parameter]], module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``groups`` in the module's registration order."""
    in_groups = {p for group in groups for p in group}
    ordered = [p for p in module.parameters() if p in in_groups]
    strided = next((p for p in ordered if not p.is_contiguous()), None)
    if strided is not None:
        name = next(n for n, p in module.named_parameters() if p is strided)
        raise ValueError(
            f"parameter '{name}' is not contiguous (strides {strided.stride()}); ds_tensorshard moves "
            "parameters as flat storage: make it contiguous before deepspeed.initialize"
        )
    if len(ordered) != len(in_groups):
        stray = next(p for group in groups for p in group if p not in set(ordered))
        raise ValueError(
            f"an optimizer parameter of shape {tuple(stray.shape)} is not a parameter of the model given "
            "to deepspeed.initialize; ds_tensorshard plans by parameter name"
        )
    return ordered
