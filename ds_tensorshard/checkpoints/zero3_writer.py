"""Writer of a stock ZeRO-3 checkpoint folder for ``n`` ranks from any checkpoint source (``--to zero --stage 3``).

The layout is the one :mod:`.zero3_source` reads, as DeepSpeed 0.19's ZeRO-3 writes it: each param group's trained
tensors, in order, cut into sub-groups of at least ``zero_optimization.sub_group_size`` partition elements (the
source's config; DeepSpeed's default 1e9), each tensor in ``n`` pieces of ``ceil(numel / n)`` elements, rank ``r``'s
sub-group flat its pieces in order, zero-padded; the optimizer state as the same flats; each rank's module file
with a placeholder per parameter, the buffers whole and its pieces of the frozen parameters. Stock DeepSpeed loads
it at ``n`` ranks and resumes; one rank's files are built (its share of the masters and moments) at a time.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch

from ds_tensorshard.checkpoints.files import save_atomic
from ds_tensorshard.checkpoints.saved_module import SavedModule
from ds_tensorshard.checkpoints.sources import CHECKPOINT_ID_KEY, CheckpointSource
from ds_tensorshard.checkpoints.stock_layout import elementwise_state_keys, stock_rank_file, stock_scaler_fields
from ds_tensorshard.checkpoints.stock_tools import without_universal_refusal
from ds_tensorshard.checkpoints.zero3_source import FROZEN_FRAGMENTS, piece, zero3_model_states_name

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size


def sub_groups(source: CheckpointSource, world_size: int) -> list[tuple[int, list[str]]]:
    """``(param group, tensor names)`` of each sub-group, as stock ZeRO-3 cuts them at ``world_size`` ranks."""
    config = source.model_states.get("ds_config")
    zero = (config.get("zero_optimization") or {}) if isinstance(config, Mapping) else {}
    size = int(zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
    out: list[tuple[int, list[str]]] = []
    for g, names in enumerate(source.group_names):
        current: list[str] = []
        elements = 0
        for i, name in enumerate(names):
            current.append(name)
            elements += piece(math.prod(source.shapes[name]), world_size)
            if elements >= size or i == len(names) - 1:
                out.append((g, current))
                current, elements = [], 0
    return out


def _flats(
    source: CheckpointSource, subs: list[tuple[int, list[str]]], keys: list[list[str]], rank: int, world_size: int
) -> tuple[list[torch.Tensor], dict[int, dict]]:
    """Rank ``rank``'s flat master of each sub-group and the optimizer state over it (flats of ``keys`` and step)."""
    masters: list[torch.Tensor] = []
    state: dict[int, dict] = {}
    for s, (g, names) in enumerate(subs):
        sizes = [piece(math.prod(source.shapes[n]), world_size) for n in names]
        flats = {k: torch.zeros(sum(sizes), dtype=torch.float32, device="cpu") for k in ("master", *keys[g])}
        step = None
        offset = 0
        for name, size in zip(names, sizes):
            numel = math.prod(source.shapes[name])
            lo, hi = rank * size, min(numel, (rank + 1) * size)
            if lo < hi:
                saved = source.tensor(name)
                step = saved.state.get("step") if step is None else step
                for key, flat in flats.items():
                    value = saved.master if key == "master" else saved.state[key]
                    flat[offset : offset + hi - lo].copy_(value.reshape(-1)[lo:hi])
            offset += size
        masters.append(flats.pop("master"))
        if flats or step is not None:
            state[s] = {**({"step": step} if step is not None else {}), **flats}
    return masters, state


def _optimizer_file(
    source: CheckpointSource, subs: list[tuple[int, list[str]]], keys: list[list[str]], rank: int, world_size: int
) -> dict:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    masters, state = _flats(source, subs, keys, rank, world_size)
    scaler = stock_scaler_fields(source)
    hyper = source.param_groups or [{} for _ in source.group_names]
    groups = [{**h, "params": [s for s, (g, _) in enumerate(subs) if g == i]} for i, h in enumerate(hyper)]
    return {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": scaler["loss_scaler"] or LossScaler(scale=1.0),  # stage 3 calls it even in fp32
            "dynamic_loss_scale": scaler["dynamic_loss_scale"],
            "overflow": scaler["overflow"],
            "partition_count": world_size,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": masters,
        },
        "ds_config": source.model_states.get("ds_config"),
        "ds_version": source.model_states.get("ds_version"),
    }


def _fragment(value: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of a whole tensor, zero-padded to ``ceil(numel / world_size)`` elements."""
    flat = value.reshape(-1)
    size = piece(flat.numel(), world_size)
    out = torch.zeros(size, dtype=flat.dtype, device="cpu")
    lo, hi = rank * size, min(flat.numel(), (rank + 1) * size)
    if lo < hi:
        out[: hi - lo].copy_(flat[lo:hi])
    return out


def _model_states(
    source: CheckpointSource, subs: list[tuple[int, list[str]]], frozen: list[str], rank: int, world_size: int
) -> dict:
    """Rank ``rank``'s module file: a placeholder per parameter, the buffers whole, its pieces of the frozen ones."""
    states = without_universal_refusal(
        {k: v for k, v in source.model_states.items() if k not in (CHECKPOINT_ID_KEY, FROZEN_FRAGMENTS)}
    )
    saved = SavedModule(source)
    buffers = set(states.get("buffer_names") or ())
    states["module"] = OrderedDict(
        (n, v if n in buffers or not torch.is_tensor(v) else torch.empty(0, dtype=v.dtype, device="cpu"))
        for n, v in (states.get("module") or {}).items()
    )
    states["param_shapes"] = [OrderedDict((n, torch.Size(source.shapes[n])) for n in names) for _, names in subs]
    states["frozen_param_shapes"] = OrderedDict((n, torch.Size(saved.shape(n) or ())) for n in frozen)
    fragments = OrderedDict()
    for name in frozen:
        value = saved.value(name)
        if value is not None:
            fragments[name] = _fragment(value, rank, world_size)
    if rank != 0:  # DeepSpeed records the ties on rank 0 only
        states["shared_params"] = {}
    states["dp_world_size"] = world_size
    order = list(states)
    order.insert(order.index("shared_params") + 1 if "shared_params" in order else len(order), FROZEN_FRAGMENTS)
    return {k: fragments if k == FROZEN_FRAGMENTS else states[k] for k in order}  # stock's order of entries


def _frozen(source: CheckpointSource) -> list[str]:
    """The parameters the optimizer does not train (module entries that are neither buffers nor tied aliases)."""
    states = source.model_states
    buffers = set(states.get("buffer_names") or ())
    aliases = set((states.get("shared_params") or {}).keys())
    saved = SavedModule(source)
    return [
        n
        for n, v in (states.get("module") or {}).items()
        if torch.is_tensor(v) and n not in buffers and n not in aliases and n not in source.shapes
        if saved.shape(n) is not None and math.prod(saved.shape(n) or (0,)) > 0
    ]


def to_zero3(
    source: CheckpointSource,
    dst: str,
    tag: str,
    world_size: int,
    mp_rank: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write ``source`` as stock ZeRO-3 writes a save of ``world_size`` ranks into ``dst/tag``;
    ``progress(done, total)`` after each rank's files."""
    folder = os.path.join(dst, tag)
    os.makedirs(folder, exist_ok=True)
    subs = sub_groups(source, world_size)
    keys = [elementwise_state_keys(source, names) for names in source.group_names]
    frozen = _frozen(source)
    for rank in range(world_size):
        save_atomic(
            _optimizer_file(source, subs, keys, rank, world_size), stock_rank_file(folder, rank, source, mp_rank)
        )
        save_atomic(
            _model_states(source, subs, frozen, rank, world_size),
            os.path.join(folder, zero3_model_states_name(rank, mp_rank)),
        )
        if progress is not None:
            progress(rank + 1, world_size)
