"""``ds-tensorshard plan --stage 3``: what each rank keeps and what a step communicates at ZeRO stage 3, against
stock ZeRO-3 at its defaults, over meta shapes (no tensor is built).

Memory: ds_tensorshard keeps each tensor (or dim-0 block) on its owner under the plan of stages 1/2 (on
accelerators, with the tensors :func:`~ds_tensorshard.parameters.ownership.cut_names` gives in a block on every
rank), plus a gathered copy of every persistent parameter (``stage3_param_persistence_threshold``) it does not
own; stock keeps ``ceil(numel / n)`` of each tensor, plus the whole of each persistent one. The optimizer state
(fp32 master and Adam's two moments) follows the owned tensors.
Communication: :mod:`~ds_tensorshard.datapath.stage3_cost`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.cost_model import DEFAULT_NETWORK, Cost, Network, padded_bytes, tensorshard_stripes_cost
from ds_tensorshard.datapath.defaults import ACCELERATOR, choose_layout
from ds_tensorshard.datapath.plan import OwnershipPlan, SplitMode, plan_ownership
from ds_tensorshard.datapath.stage3_cost import (
    STOCK_PERSISTENCE,
    STOCK_PREFETCH_BUCKET,
    batch_spans,
    fetch_batches,
    gather_route,
    module_trace,
    persistent_of,
    stock_zero3_cost,
    tensorshard_zero3_cost,
)
from ds_tensorshard.parameters.ownership import cut_names

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
    names: Sequence[str], numels: Sequence[int], plans: dict[str, OwnershipPlan], net: Network, element_bytes: int
) -> dict[str, Any]:
    """Stock ZeRO-3's collectives per step against ds_tensorshard on accelerators (``plans["accelerators"]``, per
    batch the route :func:`gather_route` chooses), with whole tensors (stage 2's plan, ``plans["whole"]``) and
    those routes, and with whole tensors and every batch by broadcasts (what CPU ranks run)."""
    n = plans["whole"].world_size
    batches = fetch_batches(numels, module_trace(names))
    stock = stock_zero3_cost(numels, batches, n, net, element_bytes)

    def cost(plan: OwnershipPlan, route: str) -> Cost:
        blocks = [plan.blocks[name] for name in names]
        reduction = lambda: _reduction(numels, plan.numel_per_rank, net, element_bytes)  # noqa: E731
        return tensorshard_zero3_cost(blocks, numels, batches, n, net, element_bytes, reduction, route)

    default, whole = cost(plans["accelerators"], "default"), cost(plans["whole"], "default")
    per_owner = cost(plans["whole"], "per_owner")
    ratio = lambda cost: cost.seconds / stock.seconds if stock.seconds else 1.0  # noqa: E731
    blocks = [plans["accelerators"].blocks[name] for name in names]
    routes = Counter(
        gather_route(spans, padded_bytes(numels, batch, n, element_bytes), n) if n > 1 else "broadcasts"
        for batch, spans in zip(batches, batch_spans(blocks, batches, element_bytes))
    )
    return {
        "network": asdict(net),
        "element_bytes": element_bytes,
        "batches": len(batches),
        "largest_batch_numel": max((sum(numels[p] for p in b) for b in batches), default=0),
        "prefetch_bucket_numel": STOCK_PREFETCH_BUCKET,
        "stock_zero3": asdict(stock),
        "tensorshard_whole": asdict(whole),
        "whole_time_ratio": ratio(whole),
        "tensorshard_per_owner": asdict(per_owner),
        "per_owner_time_ratio": ratio(per_owner),
        "default": {**asdict(default), "time_ratio": ratio(default), "routes": dict(sorted(routes.items()))},
    }


def stage3_plan_report(
    shapes: Shapes,
    world_size: int,
    split: SplitMode = "auto",
    network: Network = DEFAULT_NETWORK,
    element_bytes: int = 2,
) -> dict[str, Any]:
    """The stage-3 plan of ``shapes`` at ``world_size`` ranks on accelerators (the tensors :func:`cut_names`
    cuts, the rest as stage 2's plan): memory per rank and communication per step."""
    names = [name for name, _ in shapes]
    numels = [math.prod(shape) for _, shape in shapes]
    cut = cut_names(dict(shapes), world_size, element_bytes)
    plans = {
        "whole": plan_ownership(shapes, world_size, split=split),
        "accelerators": plan_ownership(shapes, world_size, split=split, cut=cut),
    }
    return {
        "stage": 3,
        "world_size": world_size,
        "split_tensors": split,
        "tensors": len(shapes),
        "total_numel": sum(numels),
        "cut": len(cut),
        "split": plans["accelerators"].split,
        "memory": memory_report(names, numels, plans["accelerators"]),
        "communication": communication_report(names, numels, plans, network, element_bytes),
    }


def format_stage3_report(report: dict[str, Any]) -> list[str]:
    """The report as text lines."""
    mem, comm, n = report["memory"], report["communication"], report["world_size"]
    ms = lambda cost: f"{cost['launches']:,} collectives, {cost['seconds'] * 1e3:,.1f} ms"  # noqa: E731
    net = comm["network"]
    routes = ", ".join(f"{count} by {route.replace('_', '-')}" for route, count in comm["default"]["routes"].items())
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
        f"    ds_tensorshard on accelerators ({report['cut']} tensors in a block of rows on every rank; per batch "
        f"the route furthest below stock's on the fabric where it fares worst: {routes}; the stripes' "
        f"reduce-scatters): {ms(comm['default'])} = {comm['default']['time_ratio']:.2f}x stock",
        f"    ds_tensorshard with every tensor whole (stage 2's plan), the same choice of routes: "
        f"{ms(comm['tensorshard_whole'])} = {comm['whole_time_ratio']:.2f}x stock",
        f"    ds_tensorshard with every tensor whole, every batch a broadcast per owner (CPU ranks): "
        f"{ms(comm['tensorshard_per_owner'])} = {comm['per_owner_time_ratio']:.2f}x stock",
    ]
