"""``ds-tensorshard plan --stage 3``: what each rank keeps and what a step communicates at ZeRO stage 3, against
stock ZeRO-3 at its defaults, over meta shapes (no tensor is built).

Memory: ds_tensorshard keeps each tensor (or dim-0 block) on its owner under the plan of stages 1/2, plus a
gathered copy of every persistent parameter (``stage3_param_persistence_threshold``) it does not own; stock keeps
``ceil(numel / n)`` of each tensor, plus the whole of each persistent one. The optimizer state (fp32 master and
Adam's two moments) follows the owned tensors. Communication: :mod:`~ds_tensorshard.datapath.stage3_cost`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.cost_model import DEFAULT_NETWORK, Cost, Network, tensorshard_stripes_cost
from ds_tensorshard.datapath.defaults import ACCELERATOR, choose_layout
from ds_tensorshard.datapath.plan import OwnershipPlan, SplitMode, plan_ownership
from ds_tensorshard.datapath.stage3_cost import (
    STOCK_PERSISTENCE,
    STOCK_PREFETCH_BUCKET,
    batch_spans,
    fetch_batches,
    module_trace,
    persistent_of,
    stock_zero3_cost,
    sum_gather_faster,
    tensorshard_zero3_cost,
)

Shapes = Sequence[tuple[str, Sequence[int]]]
OPTIMIZER_BYTES = 12  # per trained element: the fp32 master and Adam's two fp32 moments


def memory_report(names: Sequence[str], numels: Sequence[int], plan: OwnershipPlan) -> dict[str, Any]:
    """Parameters and optimizer state per rank outside forward and backward, against the ideal ``total / n``
    and stock ZeRO-3's."""
    n, total = plan.world_size, sum(numels)
    ideal = total / n
    persistent = persistent_of(numels, STOCK_PERSISTENCE)
    kept = list(plan.numel_per_rank)
    for p in persistent:
        owners = {block.rank for block in plan.blocks[names[p]]}
        kept = [k + (0 if r in owners else numels[p]) for r, k in enumerate(kept)]
    stock_owned = sum(-(-numel // n) for numel in numels)
    stock_kept = stock_owned + sum(numels[p] for p in persistent)
    return {
        "ideal_numel": ideal,
        "owned_fullest_numel": max(plan.numel_per_rank),
        "parameters_fullest_over_ideal": max(plan.numel_per_rank) / ideal,
        "persistent_numel": sum(numels[p] for p in persistent),
        "kept_fullest_numel": max(kept),
        "kept_fullest_over_ideal": max(kept) / ideal,
        "stock_kept_numel": stock_kept,
        "stock_kept_over_ideal": stock_kept / ideal,
        "optimizer_state_fullest_bytes": max(plan.numel_per_rank) * OPTIMIZER_BYTES,
        "optimizer_state_ideal_bytes": ideal * OPTIMIZER_BYTES,
        "optimizer_state_fullest_over_ideal": max(plan.numel_per_rank) / ideal,
        "stock_optimizer_state_over_ideal": stock_owned / ideal,
    }


def _reduction(numels: Sequence[int], owned: Sequence[int], net: Network, element_bytes: int) -> Cost:
    """The gradients' reduction on accelerators at stage 3: the default stripes (chosen as a stage-3 run chooses
    them: against stock ZeRO-3's reduction; stage 3 lays no parameter flat), their reduce-scatters alone, and the
    norm."""
    n = len(owned)
    if n == 1:
        return Cost(0, 0.0, 0.0)
    stage3 = {"zero_optimization": {"stage": 3}}
    choice = choose_layout(TensorShardConfig(), stage3, ACCELERATOR, numels, owned, element_bytes)
    routes = choice.routes(n)
    under = (routes.reduce_below, routes.gather_below)
    return tensorshard_stripes_cost(max(owned), n, choice.bucket_numel, net, element_bytes, under, gather=False)


def communication_report(
    names: Sequence[str], numels: Sequence[int], plan: OwnershipPlan, net: Network, element_bytes: int
) -> dict[str, Any]:
    """Stock ZeRO-3's collectives per step against ds_tensorshard's default (per batch a broadcast per owner, or
    one all-reduce where the model prices it faster), every batch by broadcasts, and grouped (not built)."""
    n = plan.world_size
    blocks = [plan.blocks[name] for name in names]
    batches = fetch_batches(numels, module_trace(names))
    stock = stock_zero3_cost(numels, batches, n, net, element_bytes)
    reduction = lambda: _reduction(numels, plan.numel_per_rank, net, element_bytes)  # noqa: E731
    cost = lambda route: tensorshard_zero3_cost(  # noqa: E731
        blocks, numels, batches, n, net, element_bytes, reduction, route
    )
    per_owner, default, grouped = cost("per_owner"), cost("default"), cost("grouped")
    ratio = lambda cost: cost.seconds / stock.seconds if stock.seconds else 1.0  # noqa: E731
    summed = sum(n > 1 and sum_gather_faster(spans, n) for spans in batch_spans(blocks, batches, element_bytes))
    return {
        "network": asdict(net),
        "element_bytes": element_bytes,
        "batches": len(batches),
        "largest_batch_numel": max((sum(numels[p] for p in b) for b in batches), default=0),
        "prefetch_bucket_numel": STOCK_PREFETCH_BUCKET,
        "stock_zero3": asdict(stock),
        "tensorshard_per_owner": asdict(per_owner),
        "tensorshard_grouped": asdict(grouped),
        "per_owner_time_ratio": ratio(per_owner),
        "grouped_time_ratio": ratio(grouped),
        "default": {
            **asdict(default),
            "time_ratio": ratio(default),
            "batches_by_all_reduce": summed,
            "why": _verdict(n, ratio(default), ratio(per_owner), summed, len(batches)),
        },
    }


def _verdict(n: int, default: float, per_owner: float, summed: int, batches: int) -> str:
    """The default's standing against stock ZeRO-3, in words."""
    how = (
        f"{summed} of {batches} batches gathered by one all-reduce (the other ranks adding -0.0), the rest by a "
        f"broadcast per owner (every batch by broadcasts: {per_owner:.2f}x stock)"
        if summed
        else "every batch gathered by a broadcast per owner"
    )
    standing = "within" if default <= 1.0 else "over"
    return f"{how}: {default:.2f}x stock ZeRO-3's communication at {n} ranks, {standing} it"


def stage3_plan_report(
    shapes: Shapes,
    world_size: int,
    split: SplitMode = "auto",
    network: Network = DEFAULT_NETWORK,
    element_bytes: int = 2,
) -> dict[str, Any]:
    """The stage-3 plan of ``shapes`` at ``world_size`` ranks: memory per rank and communication per step."""
    names = [name for name, _ in shapes]
    numels = [math.prod(shape) for _, shape in shapes]
    plan = plan_ownership(shapes, world_size, split=split)
    return {
        "stage": 3,
        "world_size": world_size,
        "split_tensors": split,
        "tensors": len(shapes),
        "total_numel": sum(numels),
        "split": plan.split,
        "memory": memory_report(names, numels, plan),
        "communication": communication_report(names, numels, plan, network, element_bytes),
    }


def format_stage3_report(report: dict[str, Any]) -> list[str]:
    """The report as text lines."""
    mem, comm, n = report["memory"], report["communication"], report["world_size"]
    ms = lambda cost: f"{cost['launches']:,} collectives, {cost['seconds'] * 1e3:,.1f} ms"  # noqa: E731
    net = comm["network"]
    return [
        f"world size {n}, ZeRO stage 3 (split_tensors={report['split_tensors']}): {report['tensors']} tensors, "
        f"{report['total_numel']:,} elements, {mem['ideal_numel']:,.0f} per rank ideally; "
        f"{len(report['split'])} split into dim-0 blocks",
        f"  parameters owned by the fullest rank: {mem['owned_fullest_numel']:,} = "
        f"{mem['parameters_fullest_over_ideal']:.4f}x ideal; with the persistent parameters every rank keeps "
        f"({mem['persistent_numel']:,} elements): {mem['kept_fullest_over_ideal']:.4f}x (stock ZeRO-3: "
        f"{mem['stock_kept_over_ideal']:.4f}x)",
        f"  optimizer state on the fullest rank: {mem['optimizer_state_fullest_bytes'] / 1e9:,.3f} GB = "
        f"{mem['optimizer_state_fullest_over_ideal']:.4f}x ideal (stock ZeRO-3: "
        f"{mem['stock_optimizer_state_over_ideal']:.4f}x)",
        f"  communication per step, predicted (alpha {net['alpha_us']} us per hop, {net['bus_gbps']} GB/s across "
        f"nodes, {net['intra_gbps']} GB/s within {net['intra_node_ranks']}-rank nodes, {comm['element_bytes']}-byte "
        f"elements; {comm['batches']} gather batches per step at stage3_prefetch_bucket_size "
        f"{comm['prefetch_bucket_numel']:,}):",
        f"    stock ZeRO-3 at its defaults (an all-gather per batch, reduce-scatters): {ms(comm['stock_zero3'])}",
        f"    ds_tensorshard's default (per batch a broadcast per owner or one all-reduce, the stripes' "
        f"reduce-scatters): {ms(comm['default'])} = {comm['default']['time_ratio']:.2f}x stock",
        f"    ds_tensorshard, every batch a broadcast per owner: {ms(comm['tensorshard_per_owner'])} = "
        f"{comm['per_owner_time_ratio']:.2f}x stock",
        f"    ds_tensorshard grouped (one launch per batch, not built): {ms(comm['tensorshard_grouped'])} = "
        f"{comm['grouped_time_ratio']:.2f}x stock",
        f"    default: {comm['default']['why']}",
    ]
