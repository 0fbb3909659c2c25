"""A parameter's shape and element count as planned: at ZeRO stage 3 a released parameter's ``.data`` is an empty
placeholder (shape ``(0,)``) and DeepSpeed keeps the true ones as ``ds_shape`` and ``ds_numel``."""

from __future__ import annotations

import torch


def shape_of(param: torch.Tensor) -> tuple[int, ...]:
    """The tensor's shape, whether it is gathered or released."""
    return tuple(getattr(param, "ds_shape", param.shape))


def numel_of(param: torch.Tensor) -> int:
    """The tensor's element count, whether it is gathered or released."""
    return int(getattr(param, "ds_numel", param.numel()))
