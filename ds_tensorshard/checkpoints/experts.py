"""Expert tensors in checkpoints, keyed by global expert index as stock's ``layer_L_expert_E`` files are.

On a rank, DeepSpeed names an MoE layer's experts by their local index (``...deepspeed_experts.0.``: the first
expert this rank holds); expert-parallel rank ``e`` of a layer with ``n`` local experts holds the global
experts ``e * n`` to ``e * n + n - 1`` (DeepSpeed's ``global_expert_id``). A ds_tensorshard rank file keys an
expert tensor by its global name, so that any rank of the same expert-parallel size finds each expert's
masters and moments, whichever rank of its expert-data-parallel group owned them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups

EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def global_names(module: torch.nn.Module, names: dict[torch.nn.Parameter, str]) -> dict[torch.nn.Parameter, str]:
    """Each tensor's checkpoint name: an expert tensor's with its global expert index, any other's as it is."""
    renames = {}
    for prefix, layer, _ in _moe_layers(module):
        first = groups._get_expert_parallel_rank(layer.expert_group_name) * layer.num_local_experts
        renames[prefix + EXPERTS] = first
    out = {}
    for param, name in names.items():
        out[param] = name
        for start, first in renames.items():
            local = _local_index(name, start)
            if local is not None:
                out[param] = _with_index(name, start, first + local)
    return out


def every_expert_name(module: torch.nn.Module, names: Iterable[str]) -> dict[str, list[str]]:
    """Each local name's checkpoint names on every expert-parallel rank: one per global expert that takes this
    local expert's place there; ``[name]`` for a tensor of no expert."""
    layers = _moe_layers(module)
    out = {}
    for name in names:
        out[name] = [name]
        for prefix, layer, ep_size in layers:
            local = _local_index(name, prefix + EXPERTS)
            if local is not None:
                n = layer.num_local_experts
                out[name] = [_with_index(name, prefix + EXPERTS, e * n + local) for e in range(ep_size)]
    return out


def expert_name(name: str, group: Iterable[str], ep_rank: int) -> str:
    """A stock ZeRO file's expert tensor ``name`` (a local name of expert-parallel rank 0, in ``param_shapes``
    ``group``) as held by expert-parallel rank ``ep_rank``, by global expert index: its layer's local experts are
    those ``group`` names."""
    match = re.match(rf"(.*?{re.escape(EXPERTS)})(\d+)\.", name)
    if match is None:
        return name
    start = match.group(1)
    local = {_local_index(n, start) for n in group} - {None}
    return _with_index(name, start, ep_rank * len(local) + int(match.group(2)))


def _moe_layers(module: torch.nn.Module) -> list[tuple[str, MoE, int]]:
    """``(name prefix, layer, expert-parallel size)`` of each DeepSpeed MoE layer."""
    return [
        (f"{name}." if name else "", layer, layer.ep_size)
        for name, layer in module.named_modules()
        if isinstance(layer, MoE)
    ]


def _local_index(name: str, start: str) -> int | None:
    match = re.match(re.escape(start) + r"(\d+)\.", name)
    return int(match.group(1)) if match else None


def _with_index(name: str, start: str, index: int) -> str:
    return re.sub(re.escape(start) + r"\d+\.", f"{start}{index}.", name, count=1)
