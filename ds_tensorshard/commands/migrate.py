"""Rewrite a stock ZeRO-1/2/3 DeepSpeed config for ds_tensorshard, reporting what happens to each key (at stage 3:
honoured, mapped or refused, the refusals those of :mod:`~ds_tensorshard.config.stage3_checks`)."""

from __future__ import annotations

import copy
from typing import Any

from ds_tensorshard.commands.config_check import without_auto
from ds_tensorshard.config.engine_checks import validate_engine_config
from ds_tensorshard.config.schema import BLOCK
from ds_tensorshard.config.stage3_checks import REFUSED_STAGE3_KEYS, offload_device
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


HONOURED_STAGE3_KEYS = {
    "stage": "3: each tensor (or dim-0 block) kept by its owner, gathered around each module",
    "stage3_prefetch_bucket_size": "DeepSpeed's coordinator prefetches as stock (whole tensors from their owners)",
    "stage3_max_live_parameters": "DeepSpeed's coordinator bounds the gathered parameters as stock",
    "stage3_max_reuse_distance": "DeepSpeed's coordinator keeps reused parameters gathered as stock",
    "stage3_param_persistence_threshold": "tensors this small stay gathered on every rank, as stock",
    "stage3_model_persistence_threshold": "bounds the persistent parameters, as stock",
    "stage3_gather_16bit_weights_on_model_save": "save_16bit_model gathers the whole model, as stock",
    "stage3_log_trace_cache_warnings": "DeepSpeed's coordinator logs as stock",
    "offload_param": "device cpu: the owners' tensors in host memory, copied to the device for the gathers",
    "offload_optimizer": "device cpu: each owner's fp32 masters and optimizer state in host memory",
}


def _stage3_keys(zero: dict[str, Any], report: list[str]) -> None:
    """Stage 3 kept: each key reported as honoured (stock's meaning), mapped (ds_tensorshard's) or refused; the
    refused ones (:data:`~ds_tensorshard.config.stage3_checks.REFUSED_STAGE3_KEYS`, NVMe offload) raise, named."""
    refused = []
    for key, value in zero.items():
        if key in REFUSED_STAGE3_KEYS and REFUSED_STAGE3_KEYS[key][0](value):
            refused.append(f"zero_optimization.{key}={value!r}: refused ({REFUSED_STAGE3_KEYS[key][1]})")
        elif key in ("offload_param", "offload_optimizer") and offload_device(zero, key) not in (None, "cpu"):
            refused.append(f"zero_optimization.{key}: refused (NVMe offload is not built for owned tensors)")
        elif value == "auto":
            report.append(f"zero_optimization.{key}='auto': kept, the framework fills it; {_stage3_meaning(key)}")
        else:
            report.append(f"zero_optimization.{key}={value!r}: kept, {_stage3_meaning(key)}")
    if refused:
        raise TensorShardConfigError(
            "this stage-3 config cannot run with ds_tensorshard: " + "; ".join(refused) + "; remove those keys"
        )


def _stage3_meaning(key: str) -> str:
    if key in HONOURED_STAGE3_KEYS:
        return f"honoured: {HONOURED_STAGE3_KEYS[key]}"
    if key in REFUSED_STAGE3_KEYS:
        return "honoured: off, as stock's default"
    return f"mapped: {zero_key_treatment(key)}"


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
        _stage3_keys(zero, report)
    if stage in (0, None):
        zero["stage"] = 2
        report.append(f"zero_optimization.stage: {stage!r} -> 2 (ds_tensorshard needs stage 1, 2 or 3)")
    if stage != 3:
        _map_offload(zero, report)
    for key in list(zero) if stage != 3 else ():
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
    validate_engine_config(without_auto(config))
    return config, report
