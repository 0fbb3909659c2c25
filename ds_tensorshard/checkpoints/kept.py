"""Checkpoints of parameters owned whole (ZeRO stage 3): what a rank writes of the untrained parameters it keeps,
and the module load in which each owner puts its block of every parameter into its ``ds_tensor``.

Neither needs a collective: each rank writes what it keeps and reads, by name, what it owns under the loading
plan, whatever world size and stage saved the checkpoint (:class:`~.saved_module.SavedModule`). The trained
parameters' values are their masters (the optimizer's rank file, :mod:`.optimizer_state`); the others are written
here, into the same file's ``parameters``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch

from ds_tensorshard.checkpoints.saved_module import SavedModule
from ds_tensorshard.parameters.zero_param import ZeroParam


def kept_parameters(named: Mapping[ZeroParam, str], trained: Iterable[ZeroParam], frozen: bool) -> dict[str, dict]:
    """The rank file's ``parameters``: each parameter of ``named`` that is not ``trained`` and that this rank
    keeps (its ``ds_tensor``: the whole tensor, or a dim-0 block of it with ``block``); ``frozen=False`` (a save
    with ``exclude_frozen_parameters``) leaves out those without ``requires_grad``, as the module file does."""
    skipped = set(trained)
    out: dict[str, dict[str, Any]] = {}
    for param, name in named.items():
        if param in skipped or not (frozen or param.requires_grad):
            continue
        block = param.ts_owned.my_block(param)
        if block is None:
            continue
        entry: dict[str, Any] = {"shape": list(param.ds_shape)}
        if block.numel == param.ds_numel:
            entry["value"] = param.ds_tensor.view(param.ds_shape)
        else:
            entry["value"], entry["block"] = param.ds_tensor, [block.start, block.stop]
        out[name] = entry
    return out


@torch.no_grad()
def load_owned(
    module: torch.nn.Module,
    checkpoint: Mapping[str, Any],
    saved: SavedModule,
    strict: bool,
    from_masters: Collection[torch.nn.Parameter] = (),
) -> None:
    """Stage 3's ``load_module_state_dict``: buffers (and the key check) through the module's own
    ``load_state_dict``, each parameter kept at its placeholder; then every block this rank owns copied into its
    ``ds_tensor`` (cast to its dtype) from the checkpoint's value by name, except those of ``from_masters``,
    which the optimizer's load writes from their masters next (not read twice). Every parameter must be released
    (the engine's checkpoint prologue releases them)."""
    skipped = set(from_masters)
    current = module.state_dict(keep_vars=True)
    state = {
        name: current[name].data if isinstance(current.get(name), torch.nn.Parameter) else value
        for name, value in checkpoint["module"].items()
    }
    module.load_state_dict(state, strict=strict)
    converted: list[tuple[str, ZeroParam]] = list(module.named_parameters())
    for name, param in converted:
        if param in skipped:
            continue
        block = param.ts_owned.my_block(param)
        value = saved.value(name) if block is not None else None
        if value is not None:
            param.ds_tensor.copy_(value.reshape(-1)[block.start : block.stop])
