"""Rewrite a stock ZeRO-1/2 DeepSpeed config for ds_tensorshard, reporting what happens to each key."""

from __future__ import annotations

import copy
from typing import Any

from ds_tensorshard.config.engine_checks import validate_engine_config
from ds_tensorshard.config.schema import BLOCK
from ds_tensorshard.config.zero_mapping import zero_key_treatment
from ds_tensorshard.errors import TensorShardConfigError

DROPPED_ZERO_KEYS = {
    "offload_param": "parameter offload is a ZeRO stage 3 feature; stock ZeRO-1/2 keeps parameters on the accelerator"
}


def _map_offload(zero: dict[str, Any], report: list[str]) -> None:
    """``offload_optimizer`` device cpu is kept (owners' masters and optimizer state in host memory); the
    deprecated ``cpu_offload: true`` becomes it; an NVMe device is dropped (stock ZeRO-1/2 has no NVMe optimizer
    offload either: it swaps optimizer state to NVMe at stage 3 only)."""
    if "cpu_offload" in zero:
        legacy = zero.pop("cpu_offload")
        if legacy and "offload_optimizer" not in zero:
            zero["offload_optimizer"] = {"device": "cpu"}
            report.append("zero_optimization.cpu_offload: true -> offload_optimizer {'device': 'cpu'} (its new name)")
        else:
            report.append(
                f"zero_optimization.cpu_offload={legacy!r}: dropped (no offload asked, or offload_optimizer set)"
            )
    block = zero.get("offload_optimizer")
    device = block.get("device", "none") if isinstance(block, dict) else None
    if device in ("nvme", "NVMe"):
        del zero["offload_optimizer"]
        report.append(
            "zero_optimization.offload_optimizer: dropped (device 'nvme': stock ZeRO-1/2 has no NVMe optimizer "
            "offload either, DeepSpeed swaps optimizer state to NVMe at stage 3 only)"
        )


def migrate_config(stock: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Return the ds_tensorshard config and one report line per key mapped, kept or dropped."""
    config = copy.deepcopy(stock)
    report: list[str] = []
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        zero = {}
        report.append("zero_optimization: absent; added with stage 2 (reduce every micro-step)")
    stage = zero.get("stage", 0)
    if stage == 3:
        raise TensorShardConfigError(
            "'zero_optimization.stage' 3 splits tensors and shards parameters; "
            "ds_tensorshard replaces stages 1 and 2 only, so this config cannot be migrated"
        )
    if stage in (0, None):
        zero["stage"] = 2
        report.append(f"zero_optimization.stage: {stage!r} -> 2 (ds_tensorshard needs stage 1 or 2)")
    _map_offload(zero, report)
    for key in list(zero):
        if key in DROPPED_ZERO_KEYS:
            report.append(f"zero_optimization.{key}: dropped ({DROPPED_ZERO_KEYS[key]})")
            del zero[key]
        else:
            report.append(f"zero_optimization.{key}={zero[key]!r}: kept, {zero_key_treatment(key)}")
    config["zero_optimization"] = zero
    opt_type = (config.get("optimizer") or {}).get("type")
    if opt_type is None:
        raise TensorShardConfigError(
            "the config has no 'optimizer' block: ds_tensorshard takes its inner optimizer "
            "from it (or from a client optimizer, which a config cannot name)"
        )
    report.append(f"optimizer.type={opt_type!r}: kept (runs on owned tensors only)")
    for key in sorted(k for k in config if k not in ("zero_optimization", "optimizer", BLOCK)):
        report.append(f"{key}: kept")
    existing = config.get(BLOCK)
    existing = existing if isinstance(existing, dict) else {}
    config[BLOCK] = {**existing, "enabled": True, "comm_backend": existing.get("comm_backend", "torch")}
    report.append(f"{BLOCK}: added {config[BLOCK]}")
    validate_engine_config(config)
    return config, report
