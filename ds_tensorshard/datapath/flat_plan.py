"""The flat plan (``bucket_layout: "flat"``): the tensors laid end to end in model order in one flat storage of
``world_size`` equal slots of ``ceil(total / world_size)`` elements (rounded up to :data:`ALIGNMENT`), rank ``r``
owning what lies in slot ``r``.

Every rank's owned elements are then one contiguous range of the storage, so the updated parameters travel back
with one collective over the whole storage, in place, as stock ZeRO-1/2 gathers its flat parameter group. A tensor
laid across a slot boundary is split there into element blocks, one per rank it reaches (at most ``world_size -
1`` tensors are split; none is padded, so a rank holds at most one block of a tensor, every slot is full but the
last ones, and the storage's padding at the end is fewer than ``ALIGNMENT x world_size`` elements, as stock's). The plan
depends only on the tensors' order and shapes.

Worked example, two ranks, tensors ``a``: 6, ``b``: 4, ``c``: 3, ``d``: 3 elements in model order (total 16, slots
of 8): ``a`` at 0 on rank 0; ``b`` at 6, split into ``b[0:2]`` on rank 0 and ``b[2:4]`` on rank 1; ``c`` at 10 and
``d`` at 13 on rank 1; both ranks own 8.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ds_tensorshard.datapath.plan import Block, OwnershipPlan
from ds_tensorshard.errors import PlanError

ALIGNMENT = 2  # a slot's elements are a multiple of this, as stock's partitions (nccl_start_alignment_factor): every
# rank's slot starts 4-byte aligned for NCCL's all-gather, and the storage is exactly as large as stock's flat group


def plan_flat(
    tensors: Sequence[tuple[str, int | Sequence[int]]], world_size: int, param_names: Mapping[int, str] | None = None
) -> OwnershipPlan:
    """The flat plan of named tensors ``(name, shape)`` given in model order (see the module's account)."""
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    numels: dict[str, int] = {}
    offsets: dict[str, int] = {}
    position = 0
    for name, shape in tensors:
        if name in numels:
            raise PlanError(f"tensor names in an ownership plan must be unique; '{name}' appears twice")
        numels[name] = shape if isinstance(shape, int) else math.prod(shape)
        offsets[name] = position
        position += numels[name]
    slot = -(-max(1, -(-position // world_size)) // ALIGNMENT) * ALIGNMENT
    blocks = {name: _blocks(offsets[name], numel, slot, world_size) for name, numel in numels.items()}
    loads = [0] * world_size
    for cut in blocks.values():
        for block in cut:
            loads[block.rank] += block.numel
    return OwnershipPlan(
        world_size=world_size,
        blocks=blocks,
        numels=numels,
        numel_per_rank=tuple(loads),
        param_names=dict(param_names or {}),
        flat_slot=slot,
        flat_offsets=offsets,
    )


def _blocks(offset: int, numel: int, slot: int, world_size: int) -> tuple[Block, ...]:
    """The element blocks of a tensor laid at ``offset``, one per slot it reaches (one for an empty tensor)."""
    if numel == 0:
        return (Block(min(offset // slot, world_size - 1), 0, 0),)
    first, last = offset // slot, (offset + numel - 1) // slot
    return tuple(
        Block(rank, max(offset, rank * slot) - offset, min(offset + numel, (rank + 1) * slot) - offset)
        for rank in range(first, last + 1)
    )
