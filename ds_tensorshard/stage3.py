"""ZeRO stage 3 with parameters owned whole: the engine's stage-3 optimizer (:func:`configure_stage3`).

The parameters get the whole-tensor protocol (:mod:`~ds_tensorshard.parameters`) and DeepSpeed's own
``DeepSpeedZeRoOffload`` hooks gather and release them around each module; :class:`TensorShardStage3Optimizer` is
the data path of stage 2 over the owners' tensors: gradients averaged onto their owners during backward, the norm,
and the owners' update of the tensors they keep (their ``ds_tensor``), in place. No broadcast follows a step: the
next forward's gathers fetch the updated tensors. Persistent parameters (``stage3_param_persistence_threshold``),
which every rank keeps gathered, are gathered again after the update, as stock does.

An engine without an optimizer (a reference or inference model) has nothing to replace and is stock's
``DeepSpeedZeRoOffload`` alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.utils import z3_leaf_parameter

from ds_tensorshard.checkpoints.experts import every_expert_name, global_names
from ds_tensorshard.checkpoints.kept import kept_parameters
from ds_tensorshard.checkpoints.optimizer_state import rank_file
from ds_tensorshard.checkpoints.sources import CheckpointSource
from ds_tensorshard.config import TensorShardConfig
from ds_tensorshard.config.schema import BLOCK
from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.domains import DENSE, Domain
from ds_tensorshard.datapath.offload import StateOffload
from ds_tensorshard.datapath.placement import in_model_order, trainable_groups
from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.errors import TensorShardConfigError, TensorShardUsageError
from ds_tensorshard.optimizer import TensorShardOptimizer
from ds_tensorshard.parameters.accessors import owned_grad
from ds_tensorshard.parameters.init_hooks import owning
from ds_tensorshard.parameters.owned import OwnedParameters
from ds_tensorshard.parameters.ownership import ParameterPlan, plan_parameters
from ds_tensorshard.parameters.state_offload import Stage3StateOffload
from ds_tensorshard.parameters.zero_param import ZeroParam
from ds_tensorshard.phase import Phase
from ds_tensorshard.transports import open_transport
from ds_tensorshard.transports.protocol import Transport


def configure_stage3(engine: DeepSpeedEngine, optimizer: Any, config: TensorShardConfig) -> Any:
    """The engine's ZeRO-3 optimizer: its parameters owned whole (planned, then converted by DeepSpeed's
    ``DeepSpeedZeRoOffload`` with the whole-tensor protocol) and a :class:`TensorShardStage3Optimizer`."""
    trained = [p for group in trainable_groups(optimizer) for p in group]
    owned = _owner_of_built(engine)
    if owned is None:
        comm = open_transport(config, engine.seq_data_parallel_group, engine.device)
        offload = engine.zero_offload_param()  # device cpu: the owners keep their tensors in host memory
        on_host = offload is not None and getattr(offload.device, "value", offload.device) == "cpu"
        home = torch.device("cpu") if on_host else engine.device
        owned = OwnedParameters(comm, home, _unplanned, bool(on_host and offload.pin_memory))
    n, accelerator = owned.comm.world_size, owned.comm.device.type != "cpu"
    plan = plan_parameters(engine.module, optimizer, trained, n, config.split_tensors, accelerator)
    _place(engine.module, plan, owned)
    with owning(owned):
        offload = DeepSpeedZeRoOffload(
            engine.module,
            timers=engine.timers if engine.wall_clock_breakdown() else None,
            ds_config=engine.config,
            overlap_comm=engine.zero_overlap_comm(),
            prefetch_bucket_size=engine.zero_prefetch_bucket_size(),
            max_reuse_distance=engine.zero_max_reuse_distance(),
            max_live_parameters=engine.zero_max_live_parameters(),
            param_persistence_threshold=engine.zero_param_persistence_threshold(),
            model_persistence_threshold=engine.zero_model_persistence_threshold(),
            offload_param_config=engine.zero_offload_param(),
            mpu=engine.mpu,
            zero_module_granularity_threshold=engine.zero_module_granularity_threshold(),
            log_trace_cache_warnings=engine.zero_log_trace_cache_warnings(),
        )
    return TensorShardStage3Optimizer(optimizer, engine, config, plan, offload, owned.comm)


def _owner_of_built(engine: DeepSpeedEngine) -> OwnedParameters | None:
    """The protocol of the parameters ``deepspeed.zero.Init`` built already (None: it built none); a parameter it
    sliced as stock does (its config without the block) is refused, naming it."""
    built = {name: p for name, p in engine.module.named_parameters() if hasattr(p, "ds_id")}
    sliced = next((name for name, p in built.items() if getattr(p, "ts_owned", None) is None), None)
    if sliced is not None:
        raise TensorShardConfigError(
            f"parameter '{sliced}' was built under deepspeed.zero.Init without the '{BLOCK}' block in its config: it "
            "is a stock ZeRO-3 slice, not a tensor with an owner; give zero.Init the engine's config"
        )
    owners = {id(p.ts_owned): p.ts_owned for p in built.values()}
    if len(owners) > 1:
        raise TensorShardConfigError(
            "the model's parameters were built under deepspeed.zero.Init with different process groups or "
            "transports; build them under one"
        )
    return next(iter(owners.values()), None)


def _place(module: torch.nn.Module, plan: ParameterPlan, owned: OwnedParameters) -> None:
    """Every parameter to its owners under ``plan``: one built already moves there (gathered, then kept by its
    new owners, in ``ds_id`` order on every rank), the others are converted there."""
    built: list[tuple[int, ZeroParam, tuple[Block, ...]]] = []
    param: ZeroParam
    for name, param in module.named_parameters():
        blocks = plan.kept.blocks_of(name)
        if not hasattr(param, "ds_id"):
            param.ts_blocks = blocks
        elif param.ts_blocks != blocks:
            built.append((param.ds_id, param, blocks))
    built.sort(key=lambda entry: entry[0])
    moved = [param for _, param, _ in built]
    owned.move(moved, [blocks for _, _, blocks in built])


def _unplanned(param: torch.nn.Parameter) -> tuple[Block, ...]:
    raise TensorShardUsageError(
        f"a parameter of shape {tuple(param.shape)} was converted for ZeRO-3 without an owner: it is not a "
        "parameter of the model given to deepspeed.initialize"
    )


def ds_tensor_of(param: torch.nn.Parameter, block: Block) -> torch.Tensor:
    """Where the owner keeps its block at stage 3: the parameter's ``ds_tensor``."""
    return param.ds_tensor  # type: ignore[attr-defined]


class TensorShardStage3Optimizer(TensorShardOptimizer):
    """Tensor-granular ZeRO-3: the data path of :class:`~ds_tensorshard.TensorShardOptimizer` over parameters
    whose owners alone keep them (``parameter_offload`` gathers and releases them around each module)."""

    storage = staticmethod(ds_tensor_of)
    keeps_gradients = True  # stock ZeRO-3 never zeroes its gradient partitions

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        engine: DeepSpeedEngine,
        config: TensorShardConfig,
        plan: ParameterPlan,
        parameter_offload: DeepSpeedZeRoOffload,
        comm: Transport,
    ) -> None:
        self.parameter_offload, self.parameter_plan, self._comm = parameter_offload, plan, comm
        self.persistent_parameters = parameter_offload.persistent_parameters
        self.parameter_names = dict(engine.param_names)  # every parameter (trained or not), by name
        self.save_frozen = True  # the engine's save_checkpoint sets it (False: exclude_frozen_parameters)
        super().__init__(init_optimizer, engine, config)
        self.fp16_groups = self.bit16_groups
        # stock's: each ZeRO-3 leaf module (deepspeed.utils.set_z3_leaf_modules) -> its trained parameters, as built
        self.leaf_parameters: defaultdict[torch.nn.Module, list[torch.nn.Parameter]] = defaultdict(list)
        for param in (p for group in self.bit16_groups for p in group):
            if z3_leaf_parameter(param):
                self.leaf_parameters[param.ds_z3_leaf_module].append(param)  # type: ignore[attr-defined]
        # as stock's: the backwards since the step (counted at the next forward); at 0 the next backward's gradients
        # replace the kept ones, from the second on they add
        self.micro_step_id, self._backward_ran = 0, False
        # ZeRO-Offload: ids of the tensors whose gradients reach the host this step, as stock copies them: those
        # reduced in a backward at the accumulation boundary, or in any backward with unmanaged accumulation
        self._to_host: set[int] = set()
        self._managed = bool(getattr(engine, "managed_gradient_accumulation", lambda: True)())
        self.reducer.deliver = self._replacing(self.reducer.deliver)

    def _replacing(self, deliver: Any) -> Any:
        """``deliver``, first clearing the kept gradients of the tensors a fresh backward brought (stock's copy)."""

        def deliver_replacing(bucket: Any, segment: torch.Tensor) -> None:
            if self.micro_step_id == 0:
                owned = bucket.segment_of(self.comm.rank)
                self.shard.grads.restart(owned, lambda param: id(param) in self.reducer.seen)
            deliver(bucket, segment)

        return deliver_replacing

    def _reduce_to_owners(self) -> None:
        if self.host is not None and (self._at_boundary() or not self._managed):
            self._to_host |= self.reducer.seen
        super()._reduce_to_owners()
        self._backward_ran = True

    def clear_backward_seen_flag(self) -> None:
        """At each forward: after a backward, its gradients are added to (``micro_step_id`` moves on, as stock's)."""
        if self._backward_ran:
            self.micro_step_id, self._backward_ran = self.micro_step_id + 1, False
        super().clear_backward_seen_flag()

    def _plan_tensors(self, engine: DeepSpeedEngine, config: TensorShardConfig, joint: Any) -> None:
        """One domain, the data-parallel group's, planned by :func:`plan_parameters` (the parameters' owners)."""
        self.bit16_groups = trainable_groups(self.optimizer)
        self.round_robin_bit16_groups = self.bit16_groups
        self.params = in_model_order(self.bit16_groups, engine.module)
        self.names = {p: engine.param_names[p] for p in self.params}
        self.checkpoint_names = global_names(engine.module, self.names)
        self.all_checkpoint_names = every_expert_name(engine.module, self.names.values())
        self.group_domains = [DENSE] * len(self.bit16_groups)
        self.domains = {DENSE: Domain(DENSE, self._comm, self.params, self.parameter_plan.trained)}
        self.domain_of = {p: self.domains[DENSE] for p in self.params}
        self.comm, self.plan = self._comm, self.parameter_plan.trained

    def _update_and_send(self) -> None:
        """The owners update the tensors they keep, in place; the persistent parameters are gathered again."""
        self.shard.step()
        self.shard.drop_grads()
        self.phase = Phase.ACCUMULATING
        if self.persistent_parameters:
            self.persistent_parameters[0].all_gather(self.persistent_parameters)

    def prepare_step(self, defer_broadcast: bool = False) -> None:
        """Stage 2's, where with ZeRO-Offload a tensor whose gradient stock leaves off the host this step (none
        reduced at the accumulation boundary) keeps its last step's, clipped, and stays out of the norm
        (:meth:`OwnedGradients.hold`)."""
        if self.host is not None:
            self.shard.grads.hold(p for p in self.params if id(p) not in self._to_host)
        super().prepare_step(defer_broadcast)

    def step(self, closure: Any = None) -> None:
        """Every parameter released (as stock's step begins), then the step of stage 2 without its broadcast. The
        owners keep each gradient until a backward brings another (a tensor that gets none in a step is updated
        with its last one, as stock's ZeRO-3; with ZeRO-Offload see :meth:`prepare_step`)."""
        self._partition_all_parameters()
        super().step(closure)
        self._to_host = set()
        self.micro_step_id, self._backward_ran = 0, False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As at stages 1/2; the gradients the owners have reduced stay, and the next backward's replace those of
        the tensors it brings (stock's stage 3 restarts its accumulation so: its next backward overwrites the
        gradient partitions it reaches, and a tensor it does not reach keeps its gradient). Lightning calls it
        between micro-steps when resumed from a checkpoint saved at an epoch's end."""
        super().zero_grad(set_to_none)
        self.micro_step_id, self._backward_ran = 0, False

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """Stock's: once a backward has run since the step, per group this rank's part of each trained tensor's
        averaged gradient (here the block it owns, a view of the kept gradient; empty where it owns none). Empty
        after the step, and with ZeRO-Offload (stock keeps those gradients in its host buffers)."""
        if self.host is not None or not (self._backward_ran or self.micro_step_id):
            return {}
        return {index: [owned_grad(self, p) for p in group] for index, group in enumerate(self.bit16_groups)}

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's file: its trained tensors' masters and state, as at stages 1/2, and the untrained parameters
        it keeps (``parameters``), whole or as their dim-0 blocks."""
        return rank_file(self, kept_parameters(self.parameter_names, self.params, self.save_frozen))

    def load_from_source(self, source: CheckpointSource, load_optimizer_states: bool = True) -> None:
        """The masters (and state) as at stages 1/2, then the masters into the tensors the owners keep (a
        universal checkpoint loads no module values; a 16-bit model's values are its masters, cast)."""
        super().load_from_source(source, load_optimizer_states)
        self.shard.masters_to_model()

    # -- what DeepSpeed's stage-3 engine calls --------------------------------------------------------
    def _get_param_coordinator(self):
        return self.parameter_offload.get_param_coordinator()

    def _partition_all_parameters(self) -> None:
        self.parameter_offload.partition_all_parameters()

    def backward_epilogue(self, **kwargs: Any) -> None:
        """Release what a submodule whose post-backward hook never ran left gathered (as stock's stage 3)."""
        self.parameter_offload.release_backward_leftovers()

    def empty_partition_cache(self) -> None:
        self.parameter_offload.empty_partition_cache()

    def checkpoint_event_prologue(self) -> None:
        self._partition_all_parameters()

    def checkpoint_event_epilogue(self) -> None:
        if self.persistent_parameters:
            self.persistent_parameters[0].all_gather(self.persistent_parameters)

    def _state_offload(self, buckets: Callable[[], Iterable[Bucket]]) -> StateOffload:
        """``offload_states`` moves what each rank keeps of every parameter (its ``ds_tensor``), after releasing
        the gathered ones; a reload gathers the persistent ones again (as stock's stage 3)."""
        model, persistent = list(self.parameter_names), self.persistent_parameters
        return Stage3StateOffload(self.shard, self.params, buckets, model, self.empty_partition_cache, persistent)
