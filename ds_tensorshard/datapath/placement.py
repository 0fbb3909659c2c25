"""Which tensors an engine shards, in which order, and the plan that places them on the ranks."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from ds_tensorshard.datapath.inner_optimizer import newton_schulz_work, orthogonalized_params, whole_matrix_params
from ds_tensorshard.datapath.plan import OwnershipPlan, SplitMode, plan_ownership
from ds_tensorshard.datapath.shapes import numel_of, shape_of
from ds_tensorshard.errors import TensorShardConfigError


def trainable_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.nn.Parameter]]:
    """The optimizer's groups without frozen or zero-element tensors (nothing to update: dropped, as stock)."""
    return [[p for p in group["params"] if p.requires_grad and numel_of(p) > 0] for group in optimizer.param_groups]


def in_model_order(groups: list[list[torch.nn.Parameter]], module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``groups`` in the module's registration order."""
    in_groups = {p for group in groups for p in group}
    ordered = [p for p in module.parameters() if p in in_groups]
    strided = next((p for p in ordered if not p.is_contiguous()), None)
    if strided is not None:
        name = next(n for n, p in module.named_parameters() if p is strided)
        raise TensorShardConfigError(
            f"parameter '{name}' is not contiguous (strides {strided.stride()}); ds_tensorshard moves "
            "parameters as flat storage: make it contiguous before deepspeed.initialize"
        )
    if len(ordered) != len(in_groups):
        stray = next(p for group in groups for p in group if p not in set(ordered))
        raise TensorShardConfigError(
            f"an optimizer parameter of shape {shape_of(stray)} is not a parameter of the model given "
            "to deepspeed.initialize; ds_tensorshard plans by parameter name"
        )
    return ordered


def plan_for(
    optimizer: torch.optim.Optimizer,
    names: dict[torch.nn.Parameter, str],
    world_size: int,
    split: SplitMode,
    joint_plan: OwnershipPlan | None,
    cut: AbstractSet[str] = frozenset(),
) -> OwnershipPlan:
    """The engine's plan: ``joint_plan`` (initialize_many's, checked to cover these tensors), else one for
    ``names`` alone, ``cut`` tensors in a block on every rank. Matrices the inner optimizer needs whole are never
    split; Newton-Schulz work is balanced."""
    whole = {names[p] for p in whole_matrix_params(optimizer) if p in names}
    if joint_plan is None:
        work = {names[p]: newton_schulz_work(shape_of(p)) for p in orthogonalized_params(optimizer) if p in names}
        return plan_ownership(
            ((name, shape_of(p)) for p, name in names.items()),
            world_size,
            param_names={id(p): name for p, name in names.items()},
            split=split,
            unsplittable=whole,
            work=work,
            cut=cut - whole,
        )
    if joint_plan.world_size != world_size:
        raise TensorShardConfigError(
            f"the shared plan is for {joint_plan.world_size} ranks but this engine's data-parallel group has "
            f"{world_size}"
        )
    missing = next((p for p in names if id(p) not in joint_plan.param_names), None)
    if missing is not None:
        raise TensorShardConfigError(
            f"a trainable parameter of shape {shape_of(missing)} is not in the shared plan: "
            "initialize_many plans the models' named_parameters() that require grad"
        )
    split_name = next((names[p] for p in names if names[p] in whole and len(joint_plan.blocks_of(p)) > 1), None)
    if split_name is not None:
        raise TensorShardConfigError(
            f"tensor '{split_name}' is split in the shared plan, but {type(optimizer).__name__} updates whole "
            "matrices; give the models of initialize_many 'tensorshard.split_tensors': 'never'"
        )
    return joint_plan
