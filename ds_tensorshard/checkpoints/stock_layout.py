"""What stock ZeRO's files need from any checkpoint source: the optimizer-state keys it can keep as flat slices,
the files' names (``bf16_`` prefix or not) and its loss-scaler entries. Shared by the ZeRO-1/2 writer
(:mod:`.convert`) and the ZeRO-3 writer (:mod:`.zero3_writer`)."""

from __future__ import annotations

import os

import torch

from ds_tensorshard.checkpoints.rank_file import rank_file_name, restore_loss_scaler
from ds_tensorshard.checkpoints.sources import CheckpointSource
from ds_tensorshard.errors import CheckpointError


def stock_rank_file(folder: str, rank: int, source: CheckpointSource, mp_rank: int) -> str:
    """The optimizer file of data-parallel rank ``rank`` in ``folder``, named as DeepSpeed names it for the
    source's run."""
    return os.path.join(folder, rank_file_name(rank, is_bf16(source), mp_rank))


def is_bf16(source: CheckpointSource) -> bool:
    config = source.model_states.get("ds_config") or {}
    return bool((config.get("bf16") or {}).get("enabled"))


def stock_scaler_fields(source: CheckpointSource) -> dict:
    """The loss-scaler entries of a stock ZeRO optimizer file (DeepSpeed keeps the scaler object itself)."""
    scaler = source.scaler
    if scaler is None or not scaler.loss_scaler:
        return {
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": scaler.clip_grad if scaler else 0.0,
        }
    return {
        "loss_scaler": restore_loss_scaler(scaler.loss_scaler, torch.float16),
        "dynamic_loss_scale": scaler.dynamic_loss_scale,
        "overflow": scaler.overflow,
        "clip_grad": scaler.clip_grad,
    }


def elementwise_state_keys(source: CheckpointSource, names: list[str]) -> list[str]:
    """The optimizer-state keys of a param group that stock ZeRO can hold as flat slices: tensors shaped like
    the parameter (Adam's moments, Adagrad's sum, Lion's exp_avg...). Other state (Adafactor's factors) has
    no flat layout: refused, naming it."""
    if not names:
        return []
    probe = source.tensor(names[0])
    numel = probe.master.numel()
    keys = []
    for key, value in probe.state.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            continue
        if value.numel() != numel:
            raise CheckpointError(
                f"optimizer state '{key}' of tensor '{names[0]}' has {value.numel()} elements for a "
                f"{numel}-element tensor: stock ZeRO keeps state as flat slices of the parameters, "
                "so this optimizer's checkpoint cannot be converted to it"
            )
        keys.append(key)
    return sorted(keys)
