"""Rewrite a stock ZeRO-1/2 DeepSpeed config for ds_tensorshard, reporting what happens to each key."""
from __future__ import annotations

import copy
from typing import Any

from .config import BLOCK, SHARDABLE_OPTIMIZER_TYPES, TensorShardConfigError, validate_engine_config, \
    zero_key_treatment

DROPPED_ZERO_KEYS = {
    "offload_optimizer": "offload is not supported by ds_tensorshard",
    "offload_param": "offload is not supported by ds_tensorshard",
    "cpu_offload": "offload is not supported by ds_tensorshard",
}
DROPPED_TOP_KEYS = {"zero_allow_untested_optimizer": "ds_tensorshard accepts only Adam/AdamW"}


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
        raise TensorShardConfigError("'zero_optimization.stage' 3 splits tensors and shards parameters; "
                                     "ds_tensorshard replaces stages 1 and 2 only, so this config cannot be migrated")
    if stage in (0, None):
        zero["stage"] = 2
        report.append(f"zero_optimization.stage: {stage!r} -> 2 (ds_tensorshard needs stage 1 or 2)")
    for key in list(zero):
        if key in DROPPED_ZERO_KEYS:
            report.append(f"zero_optimization.{key}: dropped ({DROPPED_ZERO_KEYS[key]})")
            del zero[key]
        else:
            report.append(f"zero_optimization.{key}={zero[key]!r}: kept, {zero_key_treatment(key)}")
    config["zero_optimization"] = zero
    for key, why in DROPPED_TOP_KEYS.items():
        if key in config:
            report.append(f"{key}: dropped ({why})")
            del config[key]
    optimizer = config.get("optimizer") or {}
    opt_type = optimizer.get("type")
    if opt_type is None or str(opt_type).lower() not in SHARDABLE_OPTIMIZER_TYPES:
        raise TensorShardConfigError(f"'optimizer.type' {opt_type!r} cannot be sharded by ds_tensorshard; "
                                     "only Adam and AdamW configs can be migrated")
    report.append(f"optimizer.type={opt_type!r}: kept (FusedAdam on owned tensors)")
    for key in sorted(k for k in config if k not in ("zero_optimization", "optimizer", BLOCK)):
        report.append(f"{key}: kept")
    existing = config.get(BLOCK) if isinstance(config.get(BLOCK), dict) else {}
    config[BLOCK] = {**existing, "enabled": True, "comm_backend": existing.get("comm_backend", "torch")}
    report.append(f"{BLOCK}: added {config[BLOCK]}")
    validate_engine_config(config)
    return config, report
