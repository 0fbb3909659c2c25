"""TensorShardOptimizer: the ZeRO-1/2 replacement that DeepSpeed's unmodified engine drives.

It runs the data path (``ds_tensorshard.datapath``), one module a phase: ``placement``/``plan`` (tensors ->
balanced sets, each owned whole or in dim-0 blocks) -> ``intake`` (the gradient hooks) -> ``buckets`` and
``reduce`` (the mean onto each owner) -> ``norm`` (global norm, overflow, clip) -> ``update`` (the inner
optimizer on owned fp32 masters) -> ``broadcast`` (owners send the updated pieces back). Each process group
that tensors are averaged over is a ``domain`` with its own transport, plan, buckets and reducer: the
data-parallel group's for dense tensors, and one per expert group for the expert tensors of MoE layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import logger
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from ds_tensorshard.checkpoints.experts import every_expert_name, global_names
from ds_tensorshard.checkpoints.optimizer_state import CheckpointMethods
from ds_tensorshard.coalesce import CoalesceMethods
from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.config.zero_mapping import describe_zero_mapping
from ds_tensorshard.datapath.backward_check import BackwardCheck
from ds_tensorshard.datapath.broadcast import Broadcast, broadcast_domains, start_broadcast, update_while_broadcasting
from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.defaults import layout_for
from ds_tensorshard.datapath.domains import DENSE, domain_names, open_domains, owned_blocks
from ds_tensorshard.datapath.early_update import EarlyUpdate, updates_early
from ds_tensorshard.datapath.engine_reduce import ReduceMethods
from ds_tensorshard.datapath.flat_choice import flat_wanted
from ds_tensorshard.datapath.flat_parameters import FlatGather
from ds_tensorshard.datapath.host import HostMemory
from ds_tensorshard.datapath.inner_optimizer import check_supported, keep_owned_state, refuse_add_param_group
from ds_tensorshard.datapath.intake import GradientIntake
from ds_tensorshard.datapath.norm import Decision, NormRules, counted_in_norm, decide, loss_scaler_of, norm_over_ranks
from ds_tensorshard.datapath.offload import OffloadMethods, StateOffload
from ds_tensorshard.datapath.placement import in_model_order, trainable_groups
from ds_tensorshard.datapath.plan import OwnershipPlan
from ds_tensorshard.datapath.precision import master_dtype
from ds_tensorshard.datapath.reduce import Averaging, autocast_comm_dtypes
from ds_tensorshard.datapath.reducers import all_buckets, reductions_done, start_reducers
from ds_tensorshard.datapath.update import OwnedShard, model_block
from ds_tensorshard.phase import Phase
from ds_tensorshard.versions import installed_release


class TensorShardOptimizer(CheckpointMethods, CoalesceMethods, OffloadMethods, ReduceMethods, ZeROOptimizer):
    """Tensor-granular ZeRO-1/2: each parameter tensor is owned whole by one data-parallel rank.

    Built by the engine (through :func:`ds_tensorshard.install`) from the basic optimizer DeepSpeed
    made out of the ``optimizer`` block or the client optimizer. ``zero_optimization.stage`` 1
    reduces at the accumulation boundary; stage 2 reduces every micro-step and keeps only owned
    gradients. ``plan`` is the :class:`~ds_tensorshard.datapath.plan.OwnershipPlan`: ``joint_plan`` when
    the engine is one of :func:`~ds_tensorshard.initialize_many`'s, else one made for this model alone.
    """

    # Read by DeepSpeed's engine and utilities: optimizer (the inner one), bit16_groups and
    # round_robin_bit16_groups, dp_process_group, partition_gradients, clip_grad, overflow,
    # _global_grad_norm (get_global_grad_norm), loss_scaler, dynamic_loss_scale, custom_loss_scaler,
    # external_loss_scale, torch_autocast_gradscaler; the engine sets is_gradient_accumulation_boundary.
    optimizer: torch.optim.Optimizer
    bit16_groups: list[list[torch.nn.Parameter]]
    round_robin_bit16_groups: list[list[torch.nn.Parameter]]
    dp_process_group: Any
    partition_gradients: bool
    clip_grad: float
    overflow: bool
    _global_grad_norm: float | torch.Tensor | None
    storage = staticmethod(model_block)  # where the model keeps a block the rank owns (stage 3: elsewhere)
    keeps_gradients = False  # stage 3: a gradient stays until a backward brings another (as stock ZeRO-3's)

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        engine: DeepSpeedEngine,
        config: TensorShardConfig,
        joint_plan: OwnershipPlan | None = None,
    ) -> None:
        super().__init__()
        check_supported(init_optimizer, engine.zero_cpu_offload())
        eager_state = len(init_optimizer.state) > 0  # e.g. Adagrad builds its state at construction
        self.optimizer = init_optimizer
        self.dp_process_group = engine.seq_data_parallel_group
        self._read_engine_settings(engine)
        self._plan_tensors(engine, config, joint_plan)
        self._own_tensors(engine, eager_state)
        self._start_reducing(engine, config)
        # an engine of initialize_many leaves its last reductions in flight after backward, to run
        # during the next model's backward; its step() (or zero_grad()) completes them
        self.reduce_in_background = joint_plan is not None
        self.phase = Phase.ACCUMULATING
        self._decision: Decision | None = None  # prepare_step's, for step() to apply
        self._defer_broadcast = False  # prepare_step(defer_broadcast=True): step() leaves its broadcasts running
        self.pending_broadcast: Broadcast | FlatGather | None = None  # the broadcasts a deferred step() started
        self.last_update_at: tuple[int, int] | None = None  # ZeRO-Offload's pipelined updates (step())
        self.checkpoint_id: str | None = None  # set by the engine's save_checkpoint before state_dict()
        init_optimizer.add_param_group = self.add_param_group  # type: ignore[method-assign]
        log_startup(self, engine)

    def _read_engine_settings(self, engine: DeepSpeedEngine) -> None:
        self._step_of = lambda: engine.global_steps
        self.partition_gradients = engine.zero_optimization_stage() >= 2
        self.rules = NormRules.of(engine, installed_release())
        self.clip_grad = self.rules.clip
        self.dtype, self.accum_dtype = engine.get_data_types()[:2]
        self.model_parallel_group = engine.mpu.get_model_parallel_group() if engine.mpu is not None else None
        self.model_parallel_rank = bwc_tensor_model_parallel_rank(engine.mpu)
        self.loss_scaler = loss_scaler_of(engine, self.dtype)
        self.dynamic_loss_scale = isinstance(self.loss_scaler, DynamicLossScaler)
        self.custom_loss_scaler, self.external_loss_scale, self.torch_autocast_gradscaler = False, None, None
        self.overflow, self._global_grad_norm = False, None
        self.backward_check = BackwardCheck.of(engine, installed_release())  # who runs a backward

    def _plan_tensors(self, engine: DeepSpeedEngine, config: TensorShardConfig, joint: OwnershipPlan | None) -> None:
        """One domain per process group (:mod:`~ds_tensorshard.datapath.domains`): the dense tensors' over the
        data-parallel group first, then each expert group's, each planned over its own group's ranks."""
        self.bit16_groups = trainable_groups(self.optimizer)
        self.round_robin_bit16_groups = self.bit16_groups
        self.params = in_model_order(self.bit16_groups, engine.module)
        self.names = {p: engine.param_names[p] for p in self.params}
        self.checkpoint_names = global_names(engine.module, self.names)  # experts by global expert index
        self.all_checkpoint_names = every_expert_name(engine.module, self.names.values())
        self.group_domains = domain_names(self.optimizer.param_groups, self.names)
        flat = flat_wanted(engine, self.optimizer, self.params, set(self.group_domains) != {DENSE}, joint, config)
        self.domains = open_domains(
            self.optimizer, self.params, self.names, self.group_domains, self.dp_process_group, config, engine.device,
            joint, flat,
        )  # fmt: skip
        self.domain_of = {p: self.domains[d] for g, d in zip(self.bit16_groups, self.group_domains) for p in g}
        self.comm, self.plan = self.domains[DENSE].comm, self.domains[DENSE].plan

    def _own_tensors(self, engine: DeepSpeedEngine, eager_state: bool) -> None:
        """Masters (fp32, or bf16 as :mod:`~ds_tensorshard.datapath.precision` says) and the inner optimizer's
        state for this rank's blocks only."""
        owned = owned_blocks(self.bit16_groups, [self.domains[d] for d in self.group_domains])
        offload = engine.zero_offload_optimizer() if engine.zero_cpu_offload() else None
        self.host = None if offload is None else HostMemory(bool(offload.pin_memory))  # ZeRO-Offload (device cpu)
        counted = functools.partial(counted_in_norm, model_parallel_rank=self.model_parallel_rank)
        dtype = master_dtype(engine, self.optimizer)
        where = (self.accum_dtype, engine.device, self.host)
        self.shard = OwnedShard(self.optimizer, owned, *where, counted, dtype, self.storage, self.keeps_gradients)
        keep_owned_state(self.optimizer, self.shard.masters.values(), eager_state)
        self.offload = self._state_offload(functools.partial(all_buckets, self.domains))

    def _state_offload(self, buckets: Callable[[], Iterable[Bucket]]) -> StateOffload:
        """What ``engine.offload_states()`` moves, and how."""
        return StateOffload(self.shard, self.params, buckets, self.domains[DENSE].flat)

    def _start_reducing(self, engine: DeepSpeedEngine, config: TensorShardConfig) -> None:
        coalescing = lambda: self._coalesce_grad_reduction  # noqa: E731
        self.intake = GradientIntake.of(engine, self.params, self.names, self._at_boundary, coalescing)
        on_cpu = engine.device.type == "cpu"
        self.layout = layout_for(config, engine._config._param_dict, self.domains[DENSE], on_cpu, self.dtype)
        self.bucket_numel, self.stripes = self.layout.bucket_numel, self.layout.layout == "stripes"
        self.early: EarlyUpdate | None = None  # ZeRO-Offload updates each tensor as its last piece arrives
        # not on a PipelineEngine: it reduces once, at the end of the batch (as stock ZeRO-1)
        if updates_early(self.rules, self.host is not None) and not isinstance(engine, PipelineEngine):
            done = functools.partial(reductions_done, self.domains)
            self.early = EarlyUpdate(self.shard, self.comm.rank, self._at_boundary, done, self.offload.homes)
        # expert gradients too are divided by the data-parallel size, then summed over their expert group (stock)
        averaging = Averaging.like_deepspeed(engine, self.comm.world_size)
        boundary = lambda: engine.micro_steps if self._at_boundary() else None  # noqa: E731
        if self.keeps_gradients and self.early is None:  # a second backward before the step adds, as stock ZeRO-3's
            boundary = lambda: None  # noqa: E731
        start_reducers(
            self.domains, self.layout, autocast_comm_dtypes(), averaging, self.shard, self.early, self.intake,
            self.names, self._step_of, boundary,
        )  # fmt: skip
        self.reducer = self.domains[DENSE].reducer
        self.intake.to_reducer = lambda param: self.domain_of[param].reducer.gradient_ready(param)
        self.intake.check_caller = self.backward_check.check

    @property
    def buckets(self) -> list[Bucket]:
        """The data-parallel domain's communication buckets, in the order reductions start (backward's, once it
        has been seen); an expert domain's are ``domains[name].reducer.buckets``."""
        return self.reducer.buckets

    def drain(self) -> None:
        """Complete every domain's reductions still in flight, and the host's part of them (ZeRO-Offload)."""
        for domain in self.domains.values():
            domain.reducer.drain()
        self.shard.grads.settle()

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
        """Engines before DeepSpeed 0.18.3 hand the backward to a ZeRO optimizer: as their stock ZeRO-1/2
        does, the loss in fp32 times the loss scale (1 unless fp16). Newer engines scale and run it themselves."""
        with self.backward_check.through_optimizer():
            self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)

    # -- norm, update, broadcast ----------------------------------------------------------------
    @torch.no_grad()
    def prepare_step(self, defer_broadcast: bool = False) -> None:
        """The part of :meth:`step` that communicates before the update: complete the reductions, sum the
        global norm over ranks, check overflow, update the loss scale (:mod:`~ds_tensorshard.datapath.norm`).
        :func:`~ds_tensorshard.step_many` runs it for every engine first, with ``defer_broadcast``, so that
        each model's update overlaps the previous one's broadcasts."""
        self.drain()
        self.shard.gradients_to_masters()
        step, before = self._step_of(), self.loss_scale
        experts = [(g, self.domains[d].comm) for g, d in enumerate(self.group_domains) if d != DENSE]
        squares = self.shard.squared_grad_norms()
        norm, unscaled, bad = norm_over_ranks(
            squares, step, before, self.comm, self.model_parallel_group, experts, self.rules.sum_dtype
        )
        self.overflow = self.rules.checks_overflow and bad
        self.loss_scaler.update_scale(self.overflow)
        self._decision = decide(
            norm, unscaled, self.overflow, before, self.loss_scale, self.rules, self._global_grad_norm
        )
        self._global_grad_norm = self._decision.reported
        self._defer_broadcast = defer_broadcast
        self.phase = Phase.PREPARED

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Global norm and overflow check, loss-scale update (:meth:`prepare_step`, unless already run),
        unscale + clip, the inner optimizer on owned tensors, broadcast."""
        if self.phase is not Phase.PREPARED:
            self.prepare_step()
        decision, self._decision = self._decision, None
        assert decision is not None
        if self.early is not None:
            self.early.next_step()
            assert not decision.overflow and decision.divisor is None, "an early update needs a step as it is"
        if decision.overflow:
            self.phase = Phase.ACCUMULATING
            self.zero_grad()
            self.shard.drop_grads()
            return
        if decision.divisor is not None and not _is_one_on_host(decision.divisor):
            self.shard.scale_grads(1.0 / decision.divisor)
        self._update_and_send()

    def _update_and_send(self) -> None:
        """The owners' update, and the updated tensors sent back to every rank (or left in flight, deferred)."""
        self.offload.homes.restore()  # as stock points its parameters back at its flat group
        if self.host is not None and not self._defer_broadcast:  # ZeRO-Offload: updates pipelined with broadcasts
            at = update_while_broadcasting(self.shard, self.buckets, self.comm, self.reducer.describe)
            self.last_update_at = at or self.last_update_at  # (buckets sent, buckets) at this rank's last update
            self.shard.drop_grads()
            self.phase = Phase.ACCUMULATING
            return
        self.shard.step()
        self.shard.drop_grads()
        if self._defer_broadcast:
            self.pending_broadcast = start_broadcast(self.domains[DENSE], self._step_of())
            self.phase = Phase.BROADCASTING
        else:
            broadcast_domains(self.domains, self._step_of())
            self.phase = Phase.ACCUMULATING

    def finish_broadcast(self) -> None:
        """Complete the broadcasts a deferred step() started (see :func:`ds_tensorshard.step_many`)."""
        self._defer_broadcast = False
        if self.pending_broadcast is not None:
            self.pending_broadcast.finish()
            self.pending_broadcast = None
        if self.phase is Phase.BROADCASTING:
            self.phase = Phase.ACCUMULATING

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (to None, or to zeros with ``set_to_none=False``), as stock does; the
        owners' reduced gradients are the step's and are dropped by it."""
        self.drain()
        if self.phase is Phase.PREPARED:
            self.phase, self._decision = Phase.ACCUMULATING, None
        self.intake.clear(self.params, set_to_none)

    add_param_group = staticmethod(refuse_add_param_group)


def log_startup(optimizer: TensorShardOptimizer, engine: DeepSpeedEngine) -> None:
    """Rank 0's start-up lines: the tensors, their buckets and layout (and why), the plan's balance, the ZeRO
    keys' mapping; and each MoE expert group's plan."""
    if engine.global_rank != 0:
        return
    plan, layout = optimizer.plan, optimizer.layout
    cut = "at the flat storage's slot boundaries" if plan.flat_slot else "into dim-0 blocks"
    kind = "stripes of flat parameters" if layout.layout == "flat" else layout.layout
    logger.info(
        f"ds_tensorshard: stage {engine.zero_optimization_stage()}, {len(optimizer.params)} tensors "
        f"({len(plan.split)} split {cut}) in {len(optimizer.buckets)} {kind} of at "
        f"most {optimizer.bucket_numel:,} elements ({layout.why}), fullest rank / ideal "
        f"{plan.imbalance:.4f}; "
        f"{describe_zero_mapping(engine._config._param_dict)}"
    )
    for domain in (d for d in optimizer.domains.values() if d.expert):
        logger.info(
            f"ds_tensorshard: MoE expert group '{domain.name}': {len(domain.params)} tensors planned over its "
            f"{domain.comm.world_size} expert-data-parallel ranks, fullest rank / ideal "
            f"{domain.plan.imbalance:.4f}"
        )


def _is_one_on_host(divisor: float | torch.Tensor) -> bool:
    """A divisor of exactly 1 read without a device sync (a float, or a tensor in host memory): multiplying by
    its reciprocal would leave every gradient as it is, so the pass over them is skipped."""
    if isinstance(divisor, torch.Tensor):
        return divisor.device.type == "cpu" and divisor.numel() == 1 and bool(divisor == 1.0)
    return divisor == 1.0
