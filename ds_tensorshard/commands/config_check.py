"""Would ``deepspeed.initialize`` accept a config? DeepSpeed's own parse, then ds_tensorshard's checks, each
with the message initialize gives; ``"auto"`` values (HF Trainer, Accelerate) listed and left out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _auto_keys(value: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose value is ``"auto"``."""
    if isinstance(value, Mapping):
        return [k for key, v in value.items() for k in _auto_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if value == "auto" else []


def without_auto(value: Any) -> Any:
    """A config without its ``"auto"`` values (the framework's to fill)."""
    if isinstance(value, Mapping):
        return {k: without_auto(v) for k, v in value.items() if v != "auto"}
    return value


def load_config(path: str) -> dict[str, Any]:
    """A DeepSpeed config file as DeepSpeed reads it (hjson, which accepts plain JSON)."""
    import hjson

    from ds_tensorshard.errors import TensorShardConfigError

    with open(path) as f:
        config = hjson.load(f, object_pairs_hook=dict)
    if not isinstance(config, dict):
        raise TensorShardConfigError(f"{path}: a DeepSpeed config must be a JSON object, got {type(config).__name__}")
    return config


def check_config(config: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
    """Would ``deepspeed.initialize`` accept ``config``? First DeepSpeed's own parse (DeepSpeedConfig), then
    ds_tensorshard's checks (:func:`.config.engine_checks.validate_engine_config`), each reported with its message.
    ``"auto"`` values are the framework's (HF Trainer, Accelerate) to fill; they are listed and left out.
    DeepSpeed checks train_batch_size = micro batch x accumulation x world size; out of a launch it sees one
    rank, so that check is made here at ``world_size`` (not at all without one: a note says so) and DeepSpeed
    is given the per-rank batch sizes."""
    from ds_tensorshard.config.engine_checks import validate_engine_config
    from ds_tensorshard.errors import TensorShardConfigError

    result: dict[str, Any] = {
        "auto_keys": _auto_keys(config),
        "deepspeed": None,
        "tensorshard": None,
        "accepted": False,
    }
    plain = without_auto(config)
    batch = [
        plain.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ]
    if world_size is not None and all(isinstance(v, int) for v in batch):
        train, micro, gas = batch
        if train != micro * gas * world_size:
            result["deepspeed"] = (
                f"Check batch related parameters. train_batch_size is not equal to "
                f"micro_batch_per_gpu * gradient_acc_step * world_size "
                f"{train} != {micro} * {gas} * {world_size}"
            )
            return result
    if world_size is not None or (isinstance(batch[0], int) and any(isinstance(v, int) for v in batch[1:])):
        if world_size is None:
            result["note"] = "train_batch_size not checked against the other batch sizes: give --world-size"
        plain = {k: v for k, v in plain.items() if k != "train_batch_size"}
    if "train_micro_batch_size_per_gpu" in result["auto_keys"] and "train_batch_size" not in plain:
        plain["train_micro_batch_size_per_gpu"] = 1  # the framework sets it from its own batch size
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig(dict(plain))
        result["deepspeed"] = "accepted"
    except Exception as err:  # DeepSpeed raises assertion, value and pydantic errors alike
        result["deepspeed"] = f"{type(err).__name__}: {err}"
        return result
    try:
        enabled = validate_engine_config(plain)
    except TensorShardConfigError as err:
        result["tensorshard"] = f"TensorShardConfigError: {err}"
        return result
    result["tensorshard"] = (
        "accepted: " + json.dumps(enabled.model_dump())
        if enabled is not None
        else "not enabled (no 'tensorshard' block with \"enabled\": true, or no ZeRO-1/2 optimizer to replace): "
        "DeepSpeed runs as stock"
    )
    result["accepted"] = True
    result["enabled"] = enabled is not None
    if enabled is not None:
        result["comm_backend"] = enabled.comm_backend
        result["split_tensors"] = enabled.split_tensors
    return result
