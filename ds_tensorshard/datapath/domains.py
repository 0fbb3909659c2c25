"""Domains: the data path once per process group that tensors are averaged over.

Dense tensors form the data-parallel domain: planned over, reduced onto and broadcast from the data-parallel
group's ranks. The expert tensors of DeepSpeed MoE layers (``allreduce=False``; the param groups
``split_params_into_different_moe_groups_for_optimizer`` makes, marked ``moe`` and named after their
expert-parallel group) form one domain per expert group name: planned over that name's
expert-data-parallel group (the ranks holding the same experts) and moved within it only. Example: 4 ranks,
2 experts, ``ep_size`` 2: ranks 0 and 2 hold expert 0, ranks 1 and 3 expert 1; the ``ep_size_2`` domain of
rank 0 plans expert 0's tensors over ranks {0, 2}, the dense domain every other tensor over {0, 1, 2, 3}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.utils import groups

from ds_tensorshard.datapath.flat_parameters import FlatParameters
from ds_tensorshard.datapath.flat_plan import plan_flat
from ds_tensorshard.datapath.placement import plan_for
from ds_tensorshard.datapath.plan import Block, OwnershipPlan
from ds_tensorshard.datapath.reduce import OverlappedReducer
from ds_tensorshard.errors import TensorShardConfigError
from ds_tensorshard.transports import open_transport
from ds_tensorshard.transports.protocol import Transport

if TYPE_CHECKING:
    from ds_tensorshard.config.schema import TensorShardConfig

DENSE = "data_parallel"  # the dense domain's name; an expert domain is named after its expert group


@dataclass
class Domain:
    """One process group's share of the data path: its transport, tensors (model order), plan and reducer; with a
    flat plan its parameters laid in one storage (:mod:`~ds_tensorshard.datapath.flat_parameters`)."""

    name: str
    comm: Transport
    params: list[torch.nn.Parameter]
    plan: OwnershipPlan
    flat: FlatParameters | None = None
    reducer: OverlappedReducer = field(init=False)

    @property
    def expert(self) -> bool:
        return self.name != DENSE


def domain_names(param_groups: list[dict], names: dict[torch.nn.Parameter, str]) -> list[str]:
    """Each param group's domain: DENSE, or for a group marked ``moe`` its ``name`` (the expert group's), as
    stock ZeRO-1/2 reads it. Expert and dense tensors in one group are refused, as stock does."""
    found = []
    for group in param_groups:
        params = [p for p in group["params"] if p in names]
        if group.get("moe"):
            stray = next((p for p in params if not is_moe_param(p) or p.group_name != group["name"]), None)
            if stray is not None:
                raise TensorShardConfigError(
                    f"parameter '{names[stray]}' is in the MoE param group '{group['name']}' but is not one of "
                    "its expert tensors; build the groups with deepspeed.moe.utils."
                    "split_params_into_different_moe_groups_for_optimizer"
                )
            found.append(group["name"])
            continue
        expert = next((p for p in params if is_moe_param(p)), None)
        if expert is not None:
            raise TensorShardConfigError(
                f"MoE expert parameter '{names[expert]}' (allreduce=False) is in a param group not marked 'moe': "
                "it must be averaged over its expert-data-parallel group; build the groups with "
                "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer"
            )
        found.append(DENSE)
    return found


def process_group_of(name: str, data_parallel_group: Any) -> Any:
    """The process group a domain's tensors are averaged over."""
    return data_parallel_group if name == DENSE else groups._get_expert_data_parallel_group(name)


def open_domains(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    names: dict[torch.nn.Parameter, str],
    group_domains: list[str],
    data_parallel_group: Any,
    config: TensorShardConfig,
    device: torch.device,
    joint: OwnershipPlan | None,
    flat: Callable[[Transport], bool] = lambda comm: False,
) -> dict[str, Domain]:
    """One domain per process group, each planned over its own group's ranks (``joint``: the plan of
    :func:`~ds_tensorshard.initialize_many`): the dense tensors' first, then each expert group's, in the same
    order on every rank. ``group_domains``: each param group's domain (:func:`domain_names`). ``flat``: whether,
    given its transport, the dense tensors go in a flat plan, laid in one storage (only without expert groups:
    :func:`~ds_tensorshard.datapath.flat_choice.flat_refusal`)."""
    if joint is not None and set(group_domains) != {DENSE}:
        raise TensorShardConfigError(
            "initialize_many with a mixture-of-experts model: a joint plan covers the data-parallel group only, "
            "and expert tensors are planned over their expert-data-parallel group; initialize it on its own"
        )
    if set(group_domains) != {DENSE} and type(optimizer).__name__ in ("Muon", "MuonWithAuxAdam"):
        raise TensorShardConfigError(
            f"the Muon optimizer ({type(optimizer).__name__}) with a mixture-of-experts model: not checked "
            "against stock ZeRO-1/2 with expert tensors; use Adam/AdamW, or disable 'tensorshard.enabled'"
        )
    domains = {}
    for name in [DENSE, *sorted(set(group_domains) - {DENSE})]:
        comm = open_transport(config, process_group_of(name, data_parallel_group), device)
        in_domain = {p for group, d in zip(optimizer.param_groups, group_domains) if d == name for p in group["params"]}
        members = [p for p in params if p in in_domain]
        if flat(comm):
            shapes = [(names[p], tuple(p.shape)) for p in members]
            plan = plan_flat(shapes, comm.world_size, {id(p): names[p] for p in members})
            domains[name] = Domain(name, comm, members, plan, FlatParameters(members, plan, comm))
            continue
        plan = plan_for(optimizer, {p: names[p] for p in members}, comm.world_size, config.split_tensors, joint)
        domains[name] = Domain(name, comm, members, plan)
    return domains


def owned_blocks(
    groups: list[list[torch.nn.Parameter]], group_domains: list[Domain]
) -> list[list[tuple[torch.nn.Parameter, Block]]]:
    """Per param group, the (tensor, block) pairs this rank owns in the group's domain."""
    return [
        [(p, b) for p in group for b in domain.plan.blocks_of(p) if b.rank == domain.comm.rank]
        for group, domain in zip(groups, group_domains)
    ]
