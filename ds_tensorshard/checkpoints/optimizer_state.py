"""The optimizer's state in and out of a checkpoint: this rank's file (a :class:`RankFile`: whole owned
tensors keyed by name, plus what every rank shares), and the owned tensors' masters, moments and step
taken back from any :class:`CheckpointSource` (a ds_tensorshard save at any world size, stock ZeRO,
universal). :class:`CheckpointMethods` holds the methods DeepSpeed's engine calls for them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScalerBase

from ds_tensorshard.checkpoints.rank_file import RankFile, loss_scaler_fields, restore_loss_scaler, step_int
from ds_tensorshard.checkpoints.sources import CheckpointSource
from ds_tensorshard.datapath.broadcast import broadcast_buckets
from ds_tensorshard.datapath.inner_optimizer import step_value
from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.datapath.shapes import numel_of, shape_of
from ds_tensorshard.errors import CheckpointError

if TYPE_CHECKING:
    from ds_tensorshard.datapath.buckets import Bucket
    from ds_tensorshard.datapath.update import OwnedShard
    from ds_tensorshard.transports.protocol import Transport


class Checkpointed(Protocol):
    """What the checkpoint methods read of :class:`~ds_tensorshard.TensorShardOptimizer`."""

    optimizer: torch.optim.Optimizer
    shard: OwnedShard
    comm: Transport
    params: list[torch.nn.Parameter]
    names: dict[torch.nn.Parameter, str]
    checkpoint_names: dict[torch.nn.Parameter, str]
    all_checkpoint_names: dict[str, list[str]]
    bit16_groups: list[list[torch.nn.Parameter]]
    checkpoint_id: str | None
    clip_grad: float
    dtype: torch.dtype
    partition_gradients: bool
    loss_scaler: LossScalerBase
    dynamic_loss_scale: bool
    overflow: bool

    @property
    def buckets(self) -> list[Bucket]: ...


class CheckpointMethods:
    """The checkpoint methods of :class:`~ds_tensorshard.TensorShardOptimizer` (one of its bases)."""

    def state_dict(self: Checkpointed) -> dict:
        """This rank's file (a :class:`~ds_tensorshard.checkpoints.rank_file.RankFile`)."""
        return rank_file(self)

    def check_checkpoint(self: Checkpointed, source: CheckpointSource) -> None:
        """Refuse, before any state is touched, a checkpoint of another model or of another expert-parallel
        size (its MoE param groups are named after it, ``ep_size_N``, in stock's files and ours)."""
        source.check_model(*layout(self))
        theirs = [g.get("name") for g in source.param_groups if g.get("moe")]
        ours = [g.get("name") for g in self.optimizer.param_groups if g.get("moe")]
        if source.param_groups and theirs != ours:
            raise CheckpointError(
                f"checkpoint {source.folder} has the MoE param groups {theirs}, this engine {ours}: resuming at "
                "another expert-parallel size is not supported (any data-parallel size with the same one is)"
            )

    def load_from_source(self: Checkpointed, source: CheckpointSource, load_optimizer_states: bool = True) -> None:
        """Take the owned tensors' masters (and moments, step, hyper-parameters, loss scale) from a checkpoint."""
        scaler = load(self, source, load_optimizer_states)
        if scaler is not None:
            self.loss_scaler, self.overflow = scaler
            self.dynamic_loss_scale = isinstance(self.loss_scaler, DynamicLossScaler)

    @torch.no_grad()
    def update_lp_params(self: Checkpointed) -> None:
        """Write the masters into the model's tensors on every rank (after a universal-checkpoint load)."""
        for param, master in self.shard.masters.items():
            param.data.copy_(master)
        broadcast_buckets(self.buckets, self.comm)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError(
            "ds_tensorshard loads checkpoints through engine.load_checkpoint(), which reads "
            "every rank's file by tensor name; the per-rank state_dict list is not used"
        )

    # weights loaded from outside (module-only loads, checkpoints without optimizer state)
    def _restore_from_bit16_weights(self: Checkpointed) -> None:
        self.shard.reload_from_params()

    def refresh_fp32_params(self: Checkpointed) -> None:
        self.shard.reload_from_params()


def rank_file(optimizer: Checkpointed, parameters: dict[str, dict] | None = None) -> dict:
    """This rank's checkpoint file, as the dict DeepSpeed saves; ``parameters``: the untrained parameters it
    keeps, at stage 3 (:func:`~ds_tensorshard.checkpoints.kept.kept_parameters`)."""
    names, inner, shard = optimizer.checkpoint_names, optimizer.optimizer, optimizer.shard
    tensors = {}
    for param, master in shard.masters.items():
        state = {k: step_int(v) if k == "step" else v for k, v in inner.state.get(master, {}).items()}
        tensors[names[param]] = {"master": master, **state}
        if not shard.is_whole(param):
            block = shard.blocks[param]
            tensors[names[param]]["block"] = [block.start, block.stop]
    groups, shapes = layout(optimizer)
    return RankFile(
        checkpoint_id=optimizer.checkpoint_id,
        world_size=optimizer.comm.world_size,
        rank=optimizer.comm.rank,
        tensors=tensors,
        group_names=groups,
        shapes=shapes,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        loss_scaler=loss_scaler_fields(optimizer.loss_scaler),
        overflow=optimizer.overflow,
        clip_grad=optimizer.clip_grad,
        zero_stage=2 if optimizer.partition_gradients else 1,  # stage 3: 2, see RankFile.zero_stage
        parameters=parameters or {},
    ).to_dict()


def layout(optimizer: Checkpointed) -> tuple[list[list[str]], dict[str, tuple[int, ...]]]:
    """Param-group membership and shapes, by checkpoint name, that a checkpoint must match: with MoE layers,
    every expert of every expert-parallel rank (the same on every rank)."""
    every = {p: optimizer.all_checkpoint_names[optimizer.names[p]] for p in optimizer.params}
    return (
        [[n for p in group for n in every[p]] for group in optimizer.bit16_groups],
        {n: shape_of(p) for p in optimizer.params for n in every[p]},
    )


@torch.no_grad()
def load(
    optimizer: Checkpointed, source: CheckpointSource, load_optimizer_states: bool
) -> tuple[LossScalerBase, bool] | None:
    """Copy the owned tensors' masters (and, with ``load_optimizer_states``, their state and the groups'
    hyper-parameters) from ``source``; returns the saved loss scaler and overflow flag, if it has them."""
    inner, shard = optimizer.optimizer, optimizer.shard
    for param, master in shard.masters.items():
        saved = source.tensor(optimizer.checkpoint_names[param])
        block = shard.blocks[param]
        master.copy_(_owned_part(saved.master, param, block, master))
        inner.state.pop(master, None)
        if load_optimizer_states and saved.state:
            state: dict[str, Any] = {
                k: _owned_part(v, param, block, master).to(master.device).contiguous() if torch.is_tensor(v) else v
                for k, v in saved.state.items()
                if k != "step"
            }
            if "step" in saved.state:
                state["step"] = step_value(inner, master, saved.state["step"])
            inner.state[master] = state
    if not load_optimizer_states:
        return None
    for group, saved_group in zip(inner.param_groups, source.param_groups):
        group.update(saved_group)
    if source.scaler is None or not source.scaler.loss_scaler:
        return None
    return restore_loss_scaler(source.scaler.loss_scaler, optimizer.dtype), source.scaler.overflow


def _owned_part(saved: torch.Tensor, param: torch.nn.Parameter, block: Block, master: torch.Tensor) -> torch.Tensor:
    """This rank's block of a saved tensor shaped like ``param``; other saved state (factors) as it is."""
    if saved.numel() != numel_of(param):
        return saved
    return saved.reshape(-1)[block.start : block.stop].view_as(master)
