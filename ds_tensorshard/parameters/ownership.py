"""Who owns each parameter at stage 3: the plan of stages 1/2 for the trained tensors, then every other parameter
(frozen, or not handed to the optimizer) placed on the emptiest ranks, so that what each rank keeps is balanced too.

The trained tensors' plan is stage 2's (:func:`~ds_tensorshard.datapath.placement.plan_for`), on accelerators with
the large tensors cut into a block of whole rows on every rank where the cost model prices their gathers faster so
(:func:`cut_names`: bandwidth-bound gathers of one owner's tensor move ``n / (n - 1)`` times stock's bytes). A
checkpoint moves between the stages unchanged either way (it holds whole tensors). The others follow,
largest first onto the rank holding the fewest elements so far (dim-0 blocks where one would not fit), by
:func:`~ds_tensorshard.datapath.plan.plan_ownership` with the trained tensors' loads as its start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from ds_tensorshard.datapath.inner_optimizer import whole_matrix_params
from ds_tensorshard.datapath.placement import plan_for
from ds_tensorshard.datapath.plan import Block, OwnershipPlan, SplitMode, even_row_blocks, plan_ownership
from ds_tensorshard.datapath.shapes import shape_of
from ds_tensorshard.datapath.stage3_cost import cut_wanted

SPLIT_AT = 100_000  # elements from which zero.Init keeps a tensor in blocks on every rank (stock's persistence size)


@dataclass(frozen=True)
class ParameterPlan:
    """The trained tensors' plan (the optimizer's) and the plan of every parameter (what each rank keeps)."""

    trained: OwnershipPlan
    kept: OwnershipPlan


def cut_names(
    shapes: Mapping[str, Sequence[int]], world_size: int, element_bytes: int, keep_whole: AbstractSet[str] = frozenset()
) -> frozenset[str]:
    """The tensors a stage-3 plan on accelerators keeps in one block of whole rows on every rank: those of at
    least :data:`SPLIT_AT` elements and ``world_size`` rows (but ``keep_whole``), all of them where
    :func:`~ds_tensorshard.datapath.stage3_cost.cut_wanted` prices their gathers so faster, else none."""
    eligible = {
        name: tuple(shape)
        for name, shape in shapes.items()
        if name not in keep_whole and len(shape) > 0 and shape[0] >= world_size and math.prod(shape) >= SPLIT_AT
    }
    return frozenset(eligible) if cut_wanted(list(eligible.values()), world_size, element_bytes) else frozenset()


def plan_parameters(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trained: list[torch.nn.Parameter],
    world_size: int,
    split: SplitMode,
    on_accelerator: bool,
) -> ParameterPlan:
    """The plan of ``module``'s parameters over ``world_size`` ranks; ``trained``: the optimizer's tensors (none
    for an engine without an optimizer); ``on_accelerator``: the tensors :func:`cut_names` gives are cut."""
    names = {param: name for name, param in module.named_parameters()}
    in_optimizer = {param: names[param] for param in trained}
    cut: frozenset[str] = frozenset()
    if on_accelerator and names:
        whole = {names[p] for p in whole_matrix_params(optimizer) if p in names} if optimizer is not None else set()
        widest = max(names, key=lambda p: math.prod(shape_of(p)))
        cut = cut_names({n: shape_of(p) for p, n in names.items()}, world_size, widest.element_size(), whole)
    if optimizer is not None and in_optimizer:
        first = plan_for(optimizer, in_optimizer, world_size, split, None, cut)
    else:
        first = plan_ownership((), world_size)
    rest = {param: name for param, name in names.items() if param not in in_optimizer}
    second = plan_ownership(
        ((name, shape_of(param)) for param, name in rest.items()),
        world_size,
        split=split,
        loads=first.numel_per_rank,
        cut=cut & set(rest.values()),
    )
    kept = OwnershipPlan(
        world_size=world_size,
        blocks={**first.blocks, **second.blocks},
        numels={**first.numels, **second.numels},
        numel_per_rank=second.numel_per_rank,
        param_names={id(param): name for param, name in names.items()},
    )
    return ParameterPlan(first, kept)


class ConstructionOwners:
    """Owners chosen as ``deepspeed.zero.Init`` creates the parameters, before the whole model is known: a tensor of
    at least :data:`SPLIT_AT` elements is kept in dim-0 blocks of whole rows, one on each rank (as stock slices
    it), a smaller one whole by the rank keeping the fewest elements so far (ties: the lower rank). So each rank
    keeps about model/n right after construction; ``deepspeed.initialize`` then moves each tensor to its owner under
    the plan of stages 1/2 (:func:`plan_parameters`), a tensor at a time."""

    def __init__(self, world_size: int) -> None:
        self.loads = [0] * world_size

    def __call__(self, param: torch.nn.Parameter) -> tuple[Block, ...]:
        shape, n = shape_of(param), len(self.loads)
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        if numel < SPLIT_AT or rows < n:
            rank = min(range(n), key=lambda r: (self.loads[r], r))
            self.loads[rank] += numel
            return (Block(rank, 0, numel),)
        blocks = even_row_blocks(shape, n)
        for block in blocks:
            self.loads[block.rank] += block.numel
        return blocks
