"""The per-rank optimizer file of a ds_tensorshard checkpoint, defined once.

DeepSpeed names the file (:func:`rank_file_name`) and stores the optimizer's ``state_dict()``
under ``optimizer_state_dict``; that payload is a :class:`RankFile`. It holds only tensors and
plain values, so it loads with ``torch.load(weights_only=True)`` and nothing else. Tensors are
whole and keyed by parameter name, so any world size can read them.

Two entries are there for DeepSpeed's own readers: ``zero_stage`` (1 or 2: the run's ZeRO stage, and 2 for a
stage-3 run, whose folder has stage 2's layout: one ``mp_rank_00_model_states.pt``), which Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` reads from the file itself to find the model file; and
``ds_version``, the first entry stock ZeRO-1/2's loader reads (and parses as a version) from
an optimizer file, which here says what the file is, so that loading it without ds_tensorshard stops
with an error naming ds_tensorshard (:data:`NOT_A_ZERO_FILE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler, LossScalerBase

from ds_tensorshard.errors import CheckpointError

FORMAT_KEY = "ds_tensorshard_format"
# 3: ``parameters`` (a stage-3 save's untrained parameters; its model-states file holds placeholders for every
# parameter); 2: loss scaler as plain fields, per-tensor state of any keys; 1: a pickled scaler
FORMAT_VERSION = 3
# stock ZeRO-1/2 (plugin off) fails on this with "packaging.version.InvalidVersion: Invalid version: '<it>'"
NOT_A_ZERO_FILE = (
    "a ds_tensorshard rank file, not a ZeRO-1/2 optimizer file: load it with ds_tensorshard enabled, or write "
    "a stock ZeRO checkpoint with `ds-tensorshard convert-checkpoint SAVE_DIR OUT_DIR --to zero --world-size N`"
)
_NAME = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def rank_file_name(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    """DeepSpeed's name for a data-parallel rank's optimizer file (``bf16_`` prefix when bf16 is enabled)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def parse_rank_file_name(entry: str) -> tuple[int, int] | None:
    """``(dp_rank, mp_rank)`` of an optimizer file name, or None for any other file."""
    match = _NAME.match(entry)
    return (int(match.group(2)), int(match.group(3))) if match else None


def loss_scaler_fields(scaler: LossScalerBase) -> dict[str, Any]:
    """A loss scaler as plain values (its numbers and flags)."""
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}


def step_int(step: Any) -> int:
    """An optimizer's ``step`` (a number or a 0-dim tensor) as the int a rank file stores."""
    return int(step.item()) if torch.is_tensor(step) else int(step)


def restore_loss_scaler(fields: Mapping[str, Any], dtype: torch.dtype) -> LossScalerBase:
    """The scaler that :func:`loss_scaler_fields` describes (dynamic or static, as it was saved)."""
    if fields.get("dynamic"):
        scaler: LossScalerBase = DynamicLossScaler(
            init_scale=fields["cur_scale"],
            scale_window=fields["scale_window"],
            min_scale=fields["min_scale"],
            delayed_shift=fields["delayed_shift"],
            consecutive_hysteresis=fields["consecutive_hysteresis"],
            raise_error_at_min_scale=fields.get("raise_error_at_min_scale", True),
            dtype=dtype,
        )
    else:
        scaler = LossScaler(scale=fields["cur_scale"])
    for key, value in fields.items():
        setattr(scaler, key, value)
    return scaler


@dataclass
class RankFile:
    """What one rank saves: the tensors it owns, and what every rank's file repeats."""

    checkpoint_id: str | None
    world_size: int
    rank: int
    tensors: dict[str, dict[str, Any]]
    """name -> ``{"master": fp32 tensor, <the inner optimizer's state keys>: tensor or number}``; for a
    tensor the plan split, the entry is this rank's block and adds ``"block": [start, stop]`` (elements
    of the flattened tensor)."""
    group_names: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    param_groups: list[dict]
    """Hyper-parameters per param group (no ``params``)."""
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    overflow: bool = False
    clip_grad: float = 0.0
    zero_stage: int | None = None
    """The ZeRO stage (1 or 2; 2 for stage 3) the saving run used; None where a converter did not know it."""
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Stage 3 only: the parameters the optimizer does not train (frozen ones) that this rank keeps, by name:
    ``{"value": tensor, "shape": [the whole tensor's shape]}``, plus ``"block": [start, stop]`` where the rank
    keeps a dim-0 block of it (``value`` is then that block, flat). At stages 1/2 they are in the module file."""
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "ds_version": NOT_A_ZERO_FILE,
            **({"zero_stage": self.zero_stage} if self.zero_stage is not None else {}),
            FORMAT_KEY: self.version,
            "checkpoint_id": self.checkpoint_id,
            "world_size": self.world_size,
            "rank": self.rank,
            "tensors": self.tensors,
            "group_names": self.group_names,
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "param_groups": self.param_groups,
            "loss_scaler": self.loss_scaler,
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
            "parameters": self.parameters,
        }

    @staticmethod
    def holds(payload: Mapping[str, Any]) -> bool:
        """Whether an ``optimizer_state_dict`` is a ds_tensorshard rank file."""
        return FORMAT_KEY in payload

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any], path: str) -> RankFile:
        version = payload.get(FORMAT_KEY)
        if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has ds_tensorshard format version {version!r}; this ds_tensorshard "
                f"reads versions 1 to {FORMAT_VERSION}"
            )
        try:
            scaler = payload["loss_scaler"]
            if isinstance(scaler, LossScalerBase):  # version 1
                scaler = loss_scaler_fields(scaler)
            tensors = {
                name: {k: v for k, v in entry.items() if v is not None} for name, entry in payload["tensors"].items()
            }
            return cls(
                checkpoint_id=payload["checkpoint_id"],
                world_size=int(payload["world_size"]),
                rank=int(payload["rank"]),
                tensors=tensors,
                group_names=[list(names) for names in payload["group_names"]],
                shapes={n: tuple(s) for n, s in payload["shapes"].items()},
                param_groups=[dict(g) for g in payload["param_groups"]],
                loss_scaler=dict(scaler or {}),
                overflow=bool(payload["overflow"]),
                clip_grad=float(payload["clip_grad"]),
                zero_stage=int(payload["zero_stage"]) if payload.get("zero_stage") is not None else None,
                parameters={n: _kept_entry(entry, path) for n, entry in (payload.get("parameters") or {}).items()},
                version=version,
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{path} is a damaged ds_tensorshard rank file ({type(err).__name__}: {err})"
            ) from None


def _kept_entry(entry: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A ``parameters`` entry of a rank file, checked (a KeyError where a key is missing)."""
    value = entry["value"]
    if not torch.is_tensor(value):
        raise CheckpointError(
            f"{path} is a damaged ds_tensorshard rank file (a parameter's value is a {type(value).__name__})"
        )
    kept = {"value": value, "shape": tuple(int(n) for n in entry["shape"])}
    if "block" in entry:
        kept["block"] = [int(entry["block"][0]), int(entry["block"][1])]
    return kept
