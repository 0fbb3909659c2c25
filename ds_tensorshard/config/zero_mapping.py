"""How ds_tensorshard treats each ``zero_optimization`` key: used, or without effect (and why)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAPPED_ZERO_KEYS = {
    "stage": "selects the mode: 1 = reduce at the accumulation boundary, 2 = reduce every micro-step",
    "reduce_bucket_size": "bucket size (elements) unless tensorshard.bucket_numel is set (else chosen with "
    "bucket_layout 'auto')",
    "reduce_scatter": "at stage 2, true divides gradients by the world size before the sum, as stock does",
    "offload_optimizer": "device cpu: each owner's fp32 masters and optimizer state in host memory (pinned with "
    "pin_memory where there is a GPU); the inner optimizer is stock's CPU one",
}
IGNORED_ZERO_KEYS = {
    "allgather_bucket_size": "updated parameters are broadcast in the reduce buckets",
    "overlap_comm": "reductions always start from gradient hooks during backward",
    "contiguous_gradients": "buckets are packed contiguously anyway",
    "round_robin_gradients": "ownership comes from the balanced plan",
    "allgather_partitions": "each owner broadcasts its updated pieces, bucket by bucket",
}


def zero_key_treatment(key: str) -> str:
    """How ds_tensorshard treats a ``zero_optimization`` key."""
    if key in MAPPED_ZERO_KEYS:
        return f"used, {MAPPED_ZERO_KEYS[key]}"
    if key in IGNORED_ZERO_KEYS:
        return f"no effect, {IGNORED_ZERO_KEYS[key]}"
    return "no effect on ds_tensorshard"


def describe_zero_mapping(param_dict: Mapping[str, Any]) -> str:
    """One log line per zero_optimization key present: how ds_tensorshard treats it."""
    zero = param_dict.get("zero_optimization", {}) or {}
    return "; ".join(f"zero_optimization.{key}={zero[key]!r}: {zero_key_treatment(key)}" for key in sorted(zero))
