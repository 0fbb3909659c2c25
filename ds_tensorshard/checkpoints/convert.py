"""Offline checkpoint conversion: to plain weights (:mod:`.consolidate`), to ds_tensorshard, back to stock ZeRO-1/2
(ZeRO-3: :mod:`.zero3_writer`); stock ZeRO-3 folders are read by :mod:`.zero3_source`.

Every writer reads the source one tensor at a time (see :mod:`.checkpoint_sources`) and writes
through :func:`.checkpoint_files.save_atomic`; ``latest`` is written last.
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from ds_tensorshard.checkpoints.consolidate import cast, lazy_state_dict, materialize, write_consolidated
from ds_tensorshard.checkpoints.files import read_latest, save_atomic, write_text_atomic
from ds_tensorshard.checkpoints.rank_file import RankFile
from ds_tensorshard.checkpoints.saved_module import SavedModule, placeholder_names
from ds_tensorshard.checkpoints.sources import (
    CHECKPOINT_ID_KEY,
    MODEL_STATES,
    CheckpointSource,
    model_states_name,
    mp_ranks,
    open_checkpoint,
)
from ds_tensorshard.checkpoints.stock_layout import elementwise_state_keys, stock_rank_file, stock_scaler_fields
from ds_tensorshard.checkpoints.stock_tools import (
    copy_deepspeed_recovery_scripts,
    refuse_universal_conversion,
    without_universal_refusal,
    write_recovery_script,
)
from ds_tensorshard.checkpoints.zero3_source import Zero3Source, is_stock_zero3, zero3_mp_ranks
from ds_tensorshard.checkpoints.zero3_writer import to_zero3
from ds_tensorshard.datapath.plan import plan_ownership
from ds_tensorshard.errors import CheckpointError


def resolve(checkpoint_dir: str, tag: str | None = None, universal: bool = False) -> tuple[str, str]:
    """``(folder, tag)`` of a checkpoint given its save dir (tag from ``latest``) or its tag folder."""
    if tag is None and (os.path.isfile(os.path.join(checkpoint_dir, MODEL_STATES)) or is_stock_zero3(checkpoint_dir)):
        return checkpoint_dir, os.path.basename(os.path.normpath(checkpoint_dir))
    if tag is None:
        tag = read_latest(checkpoint_dir, universal)
        if tag is None:
            latest = "latest_universal" if universal else "latest"
            raise CheckpointError(f"{checkpoint_dir} has no '{latest}' file; pass --tag")
    return os.path.join(checkpoint_dir, tag), tag


Progress = Callable[[int, int], None]  # progress(done, total), called as a conversion advances
ProgressFactory = Callable[[str, str], Progress]  # (label, unit) -> the progress callback of one conversion


def fp32_state_dict(
    source: CheckpointSource, progress: Progress | None = None, exclude_frozen: bool = False
) -> dict[str, torch.Tensor]:
    """Full fp32 weights for ``model.load_state_dict`` (:func:`.consolidate.lazy_state_dict`, every tensor read;
    tied aliases share their owner's tensor). ``progress(done, total)`` is called after each entry."""
    return materialize(lazy_state_dict(source, exclude_frozen), progress)


def refuse_moe(source: CheckpointSource, conversion: str) -> None:
    """A conversion that does not handle a mixture-of-experts checkpoint yet is refused, naming it."""
    if source.model_states.get("num_experts"):
        raise CheckpointError(
            f"convert-checkpoint {conversion} of a mixture-of-experts checkpoint ({source.folder}, DeepSpeed MoE "
            "layers) is not supported yet; load it with engine.load_checkpoint, or --to fp32 for the weights"
        )


def _model_states_for(source: CheckpointSource, world_size: int, checkpoint_id: str | None) -> dict:
    """The module file of a conversion: ds_tensorshard's (``checkpoint_id`` given; a stage-3 source's placeholders
    kept, its untrained parameters in the rank files, see :func:`_kept_by_rank`) or stock ZeRO-1/2's (None)."""
    states = without_universal_refusal({k: v for k, v in source.model_states.items() if k != CHECKPOINT_ID_KEY})
    if checkpoint_id is None and placeholder_names(states):  # stock ZeRO-1/2 keeps the module whole
        states["module"] = SavedModule(source).completed()
    states["dp_world_size"] = world_size
    states["param_shapes"] = [
        OrderedDict((n, torch.Size(source.shapes[n])) for n in names) for names in source.group_names
    ]
    if checkpoint_id is None:
        return states
    states[CHECKPOINT_ID_KEY] = checkpoint_id
    return refuse_universal_conversion(states)


def _zero_stage(source: CheckpointSource) -> int | None:
    """The ZeRO stage the checkpoint's run used, from its config (2 for stage 3, see RankFile.zero_stage; None
    where it does not say)."""
    config = source.model_states.get("ds_config")
    stage = ((config.get("zero_optimization") or {}) if isinstance(config, Mapping) else {}).get("stage")
    return min(int(stage), 2) if stage in (1, 2, 3) else None


def _kept_by_rank(source: CheckpointSource, world_size: int) -> list[list[str]]:
    """A stage-3 source's untrained parameters (module placeholders neither trained nor tied aliases), the names
    each rank's file keeps whole under ``parameters``, as a stage-3 save of ds_tensorshard keeps them."""
    states = source.model_states
    aliases = states.get("shared_params") or {}
    names = [n for n in placeholder_names(states) if n not in source.shapes and n not in aliases]
    shapes = {n: shape for n in names if (shape := source.kept_shape(n)) is not None}
    plan = plan_ownership(shapes.items(), world_size, split="never")
    return [list(plan.names_of(rank)) if shapes else [] for rank in range(world_size)]


def _kept_entries(source: CheckpointSource, names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        value = source.kept_parameter(name)
        if value is not None:
            out[name] = {"value": value, "shape": list(value.shape)}
    return out


def to_tensorshard(
    source: CheckpointSource, dst: str, tag: str, world_size: int, mp_rank: int = 0, progress: Progress | None = None
) -> None:
    """Write ``source`` in ds_tensorshard's layout (loadable at any world size; files for ``world_size``).
    ``progress(done, total)`` is called after each tensor read."""
    refuse_moe(source, "--to tensorshard")
    folder = os.path.join(dst, tag)
    os.makedirs(folder, exist_ok=True)
    checkpoint_id = uuid.uuid4().hex
    plan = plan_ownership(source.shapes.items(), world_size, split="never")  # which file holds which tensor
    groups = source.param_groups or [{} for _ in source.group_names]
    scaler = source.scaler
    done = 0
    kept = _kept_by_rank(source, world_size)
    for rank in range(world_size):
        tensors = {}
        for name in plan.names_of(rank):
            saved = source.tensor(name)
            tensors[name] = {"master": saved.master, **saved.state}
            done += 1
            if progress is not None:
                progress(done, len(source.shapes))
        rank_file = RankFile(
            checkpoint_id=checkpoint_id,
            world_size=world_size,
            rank=rank,
            tensors=tensors,
            group_names=source.group_names,
            shapes=source.shapes,
            param_groups=groups,
            loss_scaler=(scaler.loss_scaler or {}) if scaler else {},
            overflow=scaler.overflow if scaler else False,
            clip_grad=scaler.clip_grad if scaler else 0.0,
            zero_stage=_zero_stage(source),
            parameters=_kept_entries(source, kept[rank]),
        )
        save_atomic({"optimizer_state_dict": rank_file.to_dict()}, stock_rank_file(folder, rank, source, mp_rank))
        del rank_file, tensors  # one rank's share in memory at a time, not two
    save_atomic(_model_states_for(source, world_size, checkpoint_id), os.path.join(folder, model_states_name(mp_rank)))


def to_zero(
    source: CheckpointSource,
    dst: str,
    tag: str,
    world_size: int,
    stage: int,
    mp_rank: int = 0,
    progress: Progress | None = None,
) -> None:
    """Write ``source`` in stock ZeRO-1/2's layout for ``world_size`` ranks: per group, one flat buffer in
    param order padded to a multiple of 2 x world_size and split evenly, the padding on the last ranks;
    every entry stock's ``state_dict()`` writes, ``param_slice_mappings`` (each tensor's slice of the
    rank's partition, what ds_to_universal reads) included.
    ``progress(done, total)`` is called after each rank's file."""
    refuse_moe(source, "--to zero")
    folder = os.path.join(dst, tag)
    os.makedirs(folder, exist_ok=True)
    group_layouts = []  # per group: its tensor names, their elements, the elements of each rank's partition
    for names in source.group_names:
        total = sum(int(torch.Size(source.shapes[n]).numel()) for n in names)
        padded = -(-total // (2 * world_size)) * (2 * world_size)
        group_layouts.append((names, total, padded // world_size))
    keys = [elementwise_state_keys(source, names) for names, _, _ in group_layouts]
    step = None
    for rank in range(world_size):
        partition, step = _zero_partition(source, group_layouts, keys, rank, step)
        save_atomic(
            {
                "optimizer_state_dict": _zero_optimizer_state(source, partition, world_size, stage),
                "ds_config": source.model_states.get("ds_config"),
                "ds_version": source.model_states.get("ds_version"),
            },
            stock_rank_file(folder, rank, source, mp_rank),
        )
        del partition  # one rank's partition in memory at a time, not two
        if progress is not None:
            progress(rank + 1, world_size)
    save_atomic(_model_states_for(source, world_size, None), os.path.join(folder, model_states_name(mp_rank)))


class _ZeroPartition(NamedTuple):
    """One rank's partition of every param group, as stock ZeRO-1/2's optimizer file holds it."""

    masters: list[torch.Tensor]  # per group, the rank's fp32 slice without its padding
    state: dict[int, dict]  # per group, the optimizer state as flat slices (and the step)
    paddings: list[int]  # per group, the padding elements at the end of the rank's slice
    slices: list[OrderedDict]  # param_slice_mappings: per group, name -> its slice of this partition


def _zero_partition(
    source: CheckpointSource, group_layouts: list[tuple[list[str], int, int]], keys: list[list[str]], rank: int, step
) -> tuple[_ZeroPartition, object]:
    """Rank ``rank``'s slices of the masters and of the elementwise optimizer state; ``step`` is the first
    tensor's saved step, found on the way (None until then) and returned for the next rank."""
    from deepspeed.utils.tensor_fragment import fragment_address

    partition = _ZeroPartition([], {}, [], [])
    for g, (names, total, part) in enumerate(group_layouts):
        flats = {k: torch.zeros(part, device="cpu") for k in ("master", *keys[g])}
        lo, hi, offset = rank * part, (rank + 1) * part, 0
        partition.slices.append(OrderedDict())
        for name in names:
            numel = int(torch.Size(source.shapes[name]).numel())
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                partition.slices[g][name] = fragment_address(numel=b - a, start=a - lo)
                saved = source.tensor(name)
                step = saved.state.get("step") if step is None else step
                for key in flats:
                    value = saved.master if key == "master" else saved.state.get(key)
                    if value is not None:
                        flats[key][a - lo : b - lo].copy_(value.reshape(-1)[a - offset : b - offset])
            offset += numel
        padding = max(0, min(part, hi - total))
        partition.paddings.append(padding)
        partition.masters.append(flats["master"][: part - padding].clone())
        partition.state[g] = {**({"step": step} if step is not None else {}), **{k: flats[k] for k in keys[g]}}
    return partition, step


def _zero_optimizer_state(source: CheckpointSource, partition: _ZeroPartition, world_size: int, stage: int) -> dict:
    """The ``optimizer_state_dict`` of stock ZeRO-1/2's file for one rank's partition."""
    from deepspeed.checkpoint import constants
    from deepspeed.runtime.zero.config import ZeroStageEnum

    hyper = source.param_groups or [{} for _ in source.group_names]
    optimizer_state = {
        **stock_scaler_fields(source),
        "base_optimizer_state": {
            "state": partition.state,
            "param_groups": [{**h, "params": [g]} for g, h in enumerate(hyper)],
        },
        "single_partition_of_fp32_groups": partition.masters,
        "zero_stage": ZeroStageEnum.gradients if stage == 2 else ZeroStageEnum.optimizer_states,
        "group_paddings": partition.paddings,
    }
    if hasattr(constants, "PARAM_ALIGNMENT_PADDINGS"):  # releases whose stock files have it (no alignment here)
        optimizer_state[constants.PARAM_ALIGNMENT_PADDINGS] = [[0] * len(names) for names in source.group_names]
    optimizer_state["partition_count"] = [world_size] * len(source.group_names)
    optimizer_state["ds_version"] = source.model_states.get("ds_version")
    optimizer_state["param_slice_mappings"] = partition.slices
    return optimizer_state


class WeightsOptions(NamedTuple):
    """How ``--to fp32`` writes the weights: ``dtype`` (fp32, bf16, fp16) for floating tensors; with
    ``safetensors`` or a ``max_shard_size``, into a folder, streamed (:mod:`.consolidate`)."""

    dtype: str = "fp32"
    safetensors: bool = False
    max_shard_size: str | None = None


def _to_weights(
    ranks: list[int],
    sources: list[CheckpointSource],
    dst: str,
    weights: WeightsOptions | None,
    progress: ProgressFactory | None,
) -> str:
    """``--to fp32``: one state dict of each model-parallel rank, into ``dst`` (a file, or a folder of files)."""
    weights = weights or WeightsOptions()
    folder = weights.safetensors or weights.max_shard_size is not None
    stem, ext = os.path.splitext(dst)
    for mp_rank, source in zip(ranks, sources):
        label = f"convert to {weights.dtype}" + (f", mp rank {mp_rank}" if len(ranks) > 1 else "")
        report = progress(label, "tensor") if progress else None
        if folder:
            out = dst if len(ranks) == 1 else os.path.join(dst, f"mp_rank_{mp_rank:02d}")
            write_consolidated(
                lazy_state_dict(source), out, weights.dtype, weights.safetensors, weights.max_shard_size, report
            )
            continue
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        state = materialize(cast(lazy_state_dict(source), weights.dtype), report)
        save_atomic(state, dst if len(ranks) == 1 else f"{stem}.mp_rank_{mp_rank:02d}{ext or '.pt'}")
    return dst


def open_sources(folder: str, universal: bool = False) -> tuple[list[int], list[CheckpointSource]]:
    """The model-parallel ranks of the checkpoint in tag folder ``folder`` and a reader of each (all checked first):
    ds_tensorshard's, stock ZeRO-1/2's, universal, or stock ZeRO-3's."""
    if not universal and os.path.isdir(folder) and is_stock_zero3(folder):
        ranks = zero3_mp_ranks(folder)
        return ranks, [Zero3Source(folder, m) for m in ranks]
    ranks = mp_ranks(folder) or [0]
    return ranks, [open_checkpoint(folder, universal=universal, mp_rank=m) for m in ranks]


def convert(
    src: str,
    dst: str,
    to: str,
    tag: str | None = None,
    world_size: int = 1,
    stage: int = 2,
    universal: bool = False,
    progress: ProgressFactory | None = None,
    weights: WeightsOptions | None = None,
) -> str:
    """Convert the checkpoint at ``src`` (every model-parallel rank of it); returns what was written.

    With several model-parallel ranks, ``--to fp32`` writes one file per rank (``NAME.mp_rank_XX.pt``), or with
    ``weights`` asking for safetensors or shards one folder per rank (``DST/mp_rank_XX``).
    ``progress(label, unit)``, where given, makes the ``progress(done, total)`` callback of each model-parallel
    rank's conversion (the command line's draws a bar on a terminal); without it, nothing is reported."""
    folder, tag = resolve(src, tag, universal)
    ranks, sources = open_sources(folder, universal)
    if to == "fp32":
        return _to_weights(ranks, sources, dst, weights, progress)
    if os.path.abspath(dst) == os.path.abspath(os.path.dirname(folder)):
        raise CheckpointError(f"refusing to convert {folder} into its own save dir {dst}: write elsewhere")
    if to not in ("tensorshard", "zero"):
        raise CheckpointError(f"unknown conversion target {to!r}: 'fp32', 'zero' or 'tensorshard'")
    for mp_rank, source in zip(ranks, sources):
        label = f"convert to {to}" + (f", mp rank {mp_rank}" if len(ranks) > 1 else "")
        report = progress(label, "tensor" if to == "tensorshard" else "rank file") if progress else None
        if to == "tensorshard":
            to_tensorshard(source, dst, tag, world_size, mp_rank, report)
        elif stage == 3:
            refuse_moe(source, "--to zero --stage 3")
            to_zero3(source, dst, tag, world_size, mp_rank, report)
        else:
            to_zero(source, dst, tag, world_size, stage, mp_rank, report)
    if to == "tensorshard":
        write_recovery_script(dst)
    else:
        copy_deepspeed_recovery_scripts(dst)
    write_text_atomic(os.path.join(dst, "latest"), tag)
    return os.path.join(dst, tag)
