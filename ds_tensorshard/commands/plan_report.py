"""What a plan costs before launching: balance, split tensors, buckets, bytes on the wire.

Everything is computed in one process over meta tensors, so 1,024 ranks of a 7B model take a
fraction of a second. Wire volume follows the ring model the benchmark uses: a reduce to an
owner is sent once by every other rank (pipelined along the ring ending at the owner), a
broadcast from an owner once by every rank but the ring's last (the rank before the owner); a
ring all-reduce of N elements sends 2 (n - 1) / n N per rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from ds_tensorshard.commands.models import Experts, expert_index
from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.buckets import Bucket, build_buckets
from ds_tensorshard.datapath.cost_model import (
    DEFAULT_NETWORK,
    STOCK_REDUCE_BUCKET,
    Network,
    cost_report,
    per_owner_cost,
    stock_zero2_cost,
    stripes_padding,
    tensorshard_stripes_cost,
)
from ds_tensorshard.datapath.defaults import ACCELERATOR, DEFAULT_BUCKET_NUMEL, choose_layout, measured_on_cpu
from ds_tensorshard.datapath.flat_plan import plan_flat
from ds_tensorshard.datapath.inner_optimizer import newton_schulz_work
from ds_tensorshard.datapath.plan import OwnershipPlan, SplitMode, plan_ownership
from ds_tensorshard.errors import PlanError

Shapes = Sequence[tuple[str, Sequence[int]]]


def sent_per_rank(buckets: Sequence[Bucket], world_size: int) -> list[int]:
    """Elements each rank sends per step (every bucket reduced to its owners, then broadcast back)."""
    total = sum(b.numel for b in buckets)
    owned = [0] * world_size
    for bucket in buckets:
        for segment in bucket.segments:
            owned[segment.owner] += segment.numel
    # reduce: all but one's own; broadcast: all but the next rank's (it ends that rank's ring)
    return [2 * total - owned[r] - owned[(r + 1) % world_size] for r in range(world_size)]


def all_reduce_sent(numel: int, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * numel


def meta_buckets(
    shapes: Shapes, plan: OwnershipPlan, bucket_numel: int, dtype: torch.dtype = torch.float32
) -> list[Bucket]:
    """The buckets a run would build, over meta tensors in backward (reverse registration) order."""
    params = [torch.nn.Parameter(torch.empty(tuple(shape), device="meta", dtype=dtype)) for _, shape in shapes]
    blocks = {id(p): plan.blocks[name] for p, (name, _) in zip(params, shapes)}
    return build_buckets(list(reversed(params)), lambda p: blocks[id(p)], bucket_numel)


def muon_matrices(shapes: Shapes) -> list[str]:
    """The matrices Muon orthogonalizes in a transformer: 2-D weights inside its layers (embeddings and the
    head stay on the auxiliary Adam, as usual)."""
    return [name for name, shape in shapes if len(shape) >= 2 and (".layers." in f".{name}" or "blocks." in name)]


def newton_schulz_report(shapes: Shapes, plan: OwnershipPlan, muon: list[str]) -> dict[str, Any]:
    """Newton-Schulz work and Muon momentum per rank, next to stock ZeRO's rule: the Muon matrices form one
    flat group split evenly over the ranks, and every rank whose slice touches a matrix orthogonalizes all
    of it and keeps its full momentum."""
    shape_of = dict(shapes)
    work = {name: newton_schulz_work(tuple(shape_of[name])) for name in muon}
    total = sum(work.values())
    n = plan.world_size
    ideal = total / n
    momentum = [0] * n
    for name in muon:
        momentum[plan.blocks[name][0].rank] += math.prod(shape_of[name])
    stock_work, stock_momentum = [0.0] * n, [0] * n
    flat_total = sum(math.prod(shape_of[name]) for name in muon)
    part = -(-flat_total // n)
    offset = 0
    for name in muon:  # registration order, as stock flattens a param group
        numel = math.prod(shape_of[name])
        for rank in range(offset // part, min((offset + numel - 1) // part, n - 1) + 1):
            stock_work[rank] += work[name]
            stock_momentum[rank] += numel
        offset += numel
    return {
        "matrices": len(muon),
        "work_fullest_over_ideal": max(plan.work_per_rank) / ideal if ideal else 1.0,
        "work_bound": max(max(work.values(), default=0.0), ideal) / ideal if ideal else 1.0,
        "momentum_fullest": max(momentum),
        "momentum_ideal": flat_total / n,
        "stock_work_fullest_over_ideal": max(stock_work) / ideal if ideal else 1.0,
        "stock_momentum_fullest": max(stock_momentum),
    }


def plan_report(
    shapes: Shapes,
    world_size: int,
    bucket_numel: int,
    split: SplitMode = "auto",
    optimizer: str = "adam",
    network: Network = DEFAULT_NETWORK,
    element_bytes: int = 2,
    flat: bool = True,
) -> dict[str, Any]:
    """Balance, splits, buckets, wire volume and predicted communication time (against stock ZeRO-2's, on
    ``network`` with gradients of ``element_bytes``) of one world size, with the whole-tensor plan beside it;
    for ``optimizer="muon"`` also the Newton-Schulz work and momentum per rank against stock's rule. ``flat``:
    the default may lay the parameters flat (not in a mixture of experts' groups)."""
    started = time.perf_counter()
    muon = muon_matrices(shapes) if optimizer == "muon" else []
    shape_of = dict(shapes)
    plan = plan_ownership(
        shapes,
        world_size,
        split=split,
        unsplittable=set(muon),
        work={name: newton_schulz_work(tuple(shape_of[name])) for name in muon},
    )
    buckets = meta_buckets(shapes, plan, bucket_numel)
    seconds = time.perf_counter() - started
    never = plan if split == "never" else plan_ownership(shapes, world_size, split="never")
    sent = sent_per_rank(buckets, world_size)
    reference = all_reduce_sent(plan.total_numel, world_size)
    largest = max(shapes, key=lambda s: math.prod(s[1]))
    numels = [math.prod(shape) for _, shape in shapes]
    return {
        "world_size": world_size,
        "split_tensors": split,
        "tensors": len(shapes),
        "total_numel": plan.total_numel,
        "ideal_numel": plan.total_numel / world_size,
        "fullest_numel": max(plan.numel_per_rank),
        "emptiest_numel": min(plan.numel_per_rank),
        "imbalance": plan.imbalance,
        "largest_tensor": {"name": largest[0], "numel": math.prod(largest[1])},
        "split": plan.split,
        "never_imbalance": never.imbalance,
        "never_bound": never.imbalance_bound,
        "buckets": len(buckets),
        "largest_buffer": max((b.numel for b in buckets), default=0),
        "bucket_numel": bucket_numel,
        "sent_per_rank_max": max(sent, default=0),
        "all_reduce_sent": reference,
        "wire_ratio": max(sent, default=0) / reference if reference else 1.0,
        "plan_and_buckets_s": seconds,
        "numel_per_rank": list(plan.numel_per_rank),
        "communication": {
            **cost_report(buckets, numels, max(plan.numel_per_rank), world_size, bucket_numel, network, element_bytes),
            **default_report(shapes, plan, network, element_bytes, flat and optimizer != "muon" and split != "never"),
        },
        **({"newton_schulz": newton_schulz_report(shapes, plan, muon)} if muon else {}),
    }


def default_report(
    shapes: Shapes, plan: OwnershipPlan, network: Network, element_bytes: int, flat: bool
) -> dict[str, Any]:
    """What ``bucket_layout: "auto"`` picks on an accelerator at this plan's world size (chosen to hold on each
    fabric the cost model prices, as a run does: it cannot know its network), priced on ``network`` against stock
    ZeRO-2 at its own defaults (``reduce_bucket_size`` 5e8); with the stripes' padding, in bytes, and their routes.
    ``flat``: nothing keeps the run from flat parameters (:mod:`~ds_tensorshard.datapath.flat_choice`), planned
    then by the flat plan."""
    n, numels = plan.world_size, [math.prod(shape) for _, shape in shapes]
    flat_plan = plan_flat(shapes, n) if flat and n > 1 else None
    owned = list((flat_plan or plan).numel_per_rank)
    flat_numel = flat_plan.flat_slot * n if flat_plan else 0
    choice = choose_layout(TensorShardConfig(), {}, ACCELERATOR, numels, owned, element_bytes, flat_numel)
    stock = stock_zero2_cost(numels, n, STOCK_REDUCE_BUCKET, network, element_bytes)
    routes = choice.routes(n)  # windows: none
    under = (routes.reduce_below, routes.gather_below)
    stripe_bytes = min(choice.bucket_numel, n * max(owned)) * element_bytes  # the largest stripe
    gather_bytes = flat_numel * element_bytes if flat_numel else stripe_bytes
    ways = {"reduced_by": ("all-reduce", "reduce-scatter"), "gathered_by": ("all-reduce", "all-gather")}
    by = [size < limit for size, limit in ((stripe_bytes, under[0]), (gather_bytes, under[1]))]
    if choice.layout != "windows":
        cost = tensorshard_stripes_cost(max(owned), n, choice.bucket_numel, network, element_bytes, under, flat_numel)
        buckets, largest = -(-max(owned) // max(1, choice.bucket_numel // n)), choice.bucket_numel
        padding, padding_per_step = stripes_padding(owned, choice.bucket_numel)
    else:
        windows = meta_buckets(shapes, plan, choice.bucket_numel)
        cost = per_owner_cost(windows, n, network, element_bytes)
        buckets, largest = len(windows), max((b.numel for b in windows), default=0)
        padding = padding_per_step = 0
    return {
        "default": {
            "layout": choice.layout,
            "bucket_numel": choice.bucket_numel,
            "buckets": buckets,
            "largest_buffer": largest,
            **asdict(cost),
            "time_ratio": cost.seconds / stock.seconds if stock.seconds else 1.0,
            **{key: names[0] if taken else names[1] for (key, names), taken in zip(ways.items(), by)},
            "padding_bytes": padding * element_bytes,
            "padding_bytes_per_step": padding_per_step * element_bytes,
            "flat_padding_bytes": (flat_numel - sum(numels)) * element_bytes if flat_numel else 0,
            "why": choice.why,
        },
        "default_on_cpu": {t: measured_on_cpu(t, n) for t in ("torch", "mpi")}
        | {"one_host": "flat", "bucket_numel": DEFAULT_BUCKET_NUMEL},
        "stock_zero2_defaults": asdict(stock),
    }


def _communication_lines(comm: dict[str, Any]) -> list[str]:
    net = comm["network"]
    rows = [
        (
            "ds_tensorshard, a reduce and a broadcast per owner in a bucket (torch transport)",
            comm["tensorshard_per_owner"],
        ),
        (
            "ds_tensorshard, one launch per bucket and direction (mpi; NCCL grouped, not built)",
            comm["tensorshard_grouped"],
        ),
        (
            "ds_tensorshard, stripes (per bucket a reduce-scatter and an all-gather, or all-reduces where faster)",
            comm["tensorshard_stripes"],
        ),
        ("stock ZeRO-2 at that bucket size (all-reduce per bucket, one all-gather)", comm["stock_zero2"]),
    ]
    lines = [
        f"  communication per step, predicted (alpha {net['alpha_us']} us per hop, {net['bus_gbps']} GB/s bus across "
        f"nodes, {net['intra_gbps']} GB/s within {net['intra_node_ranks']}-rank nodes, {comm['element_bytes']}-byte "
        "gradients):"
    ]
    lines += [
        f"    {name}: {cost['launches']:,} collectives, {cost['seconds'] * 1e3:,.1f} ms "
        f"({cost['latency_s'] * 1e3:,.1f} ms of it latency)"
        for name, cost in rows
    ]
    lines.append(
        f"    ratio to stock ZeRO-2: {comm['per_owner_time_ratio']:.2f}x per owner, "
        f"{comm['grouped_time_ratio']:.2f}x grouped, {comm['stripes_time_ratio']:.2f}x stripes"
    )
    chosen, stock, cpu = comm["default"], comm["stock_zero2_defaults"], comm["default_on_cpu"]
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    lines += [
        f"    default (bucket_layout auto) on accelerators: {chosen['layout']} of {chosen['bucket_numel']:,} elements, "
        f"{chosen['buckets']:,} buckets, {chosen['launches']:,} collectives, {chosen['seconds'] * 1e3:,.1f} ms = "
        f"{chosen['time_ratio']:.2f}x stock ZeRO-2 at its defaults (reduce_bucket_size {STOCK_REDUCE_BUCKET:,}: "
        f"{stock['launches']:,} collectives, {stock['seconds'] * 1e3:,.1f} ms); padding {mb(chosen['padding_bytes'])} "
        f"in the most padded stripe's buffer, {mb(chosen['padding_bytes_per_step'])} per step",
        f"      why: {chosen['why']}",
        f"    default on CPU ranks: {cpu['one_host']} through shared memory where they share one host, else "
        f"(measured) {cpu['torch']} on torch (gloo), {cpu['mpi']} on mpi; {cpu['bucket_numel']:,}-element buckets",
    ]
    return lines


def format_report(report: dict[str, Any]) -> list[str]:
    split = sorted(report["split"].items(), key=lambda item: (-item[1], item[0]))
    split_text = ", ".join(f"{name} x{n}" for name, n in split[:6]) + (
        f" (+{len(split) - 6} more)" if len(split) > 6 else ""
    )
    split_text = f"{len(split)}: {split_text}" if split else "none"
    lines = [
        f"world size {report['world_size']} (split_tensors={report['split_tensors']}): {report['tensors']} tensors, "
        f"{report['total_numel']:,} elements, {report['total_numel'] / report['world_size']:,.0f} per rank ideally",
        f"  fullest rank / ideal {report['imbalance']:.4f} "
        f"(emptiest {report['emptiest_numel'] / report['ideal_numel']:.4f}); "
        f"whole tensors only ('never'): {report['never_imbalance']:.4f}, best possible {report['never_bound']:.4f}",
        f"  split tensors (blocks): {split_text}",
        f"  windows of {report['bucket_numel']:,} elements: {report['buckets']} buckets, largest flat buffer "
        f"{report['largest_buffer']:,} elements",
        f"  sent per rank per step {report['sent_per_rank_max']:,} elements = {report['wire_ratio']:.4f} x a ring "
        f"all-reduce ({report['all_reduce_sent']:,.0f}); plan + buckets in {report['plan_and_buckets_s'] * 1e3:.0f} ms",
    ]
    lines += _communication_lines(report["communication"])
    if "newton_schulz" in report:
        ns = report["newton_schulz"]
        lines.append(
            f"  Muon ({ns['matrices']} matrices): Newton-Schulz work, fullest rank / ideal "
            f"{ns['work_fullest_over_ideal']:.3f} (whole matrices allow {ns['work_bound']:.3f}; stock ZeRO's "
            f"slices {ns['stock_work_fullest_over_ideal']:.3f}); momentum on the fullest rank "
            f"{ns['momentum_fullest']:,} elements (ideal {ns['momentum_ideal']:,.0f}; stock "
            f"{ns['stock_momentum_fullest']:,})"
        )
    if report["world_size"] <= 8:
        lines += [f"  rank {r}: {numel:,}" for r, numel in enumerate(report["numel_per_rank"])]
    return lines


def moe_plan_report(
    shapes: Shapes,
    experts: Experts,
    world_size: int,
    expert_parallel: int,
    bucket_numel: int,
    split: SplitMode = "auto",
    optimizer: str = "adam",
    network: Network = DEFAULT_NETWORK,
    element_bytes: int = 2,
) -> dict[str, Any]:
    """The plan of a mixture of experts under expert parallelism, as DeepSpeed lays it out: the tensors outside
    the experts over the data-parallel group (``world_size`` ranks), and each expert-parallel rank's experts
    (``count / expert_parallel`` of them) over its expert-data-parallel group, ranks ``e, e + ep, e + 2 ep, ...``
    (``world_size / expert_parallel`` ranks), each with the same planner as a dense model. Such a group's
    members share a node only where a node holds more than ``expert_parallel`` ranks: its predicted times take
    ``network``'s ranks per node divided by ``expert_parallel``.

    Two-rank example: 2 experts, ``expert_parallel=2``, world 2: rank 0 holds expert 0 and rank 1 expert 1,
    each alone in its expert-data-parallel group; both share the dense tensors' plan over the 2 ranks."""
    if expert_parallel < 1:
        raise PlanError(f"--expert-parallel must be at least 1, got {expert_parallel}")
    if world_size % expert_parallel:
        raise PlanError(f"--expert-parallel {expert_parallel} does not divide --world-size {world_size}")
    if experts.count % expert_parallel:
        raise PlanError(
            f"--expert-parallel {expert_parallel} does not divide the model's {experts.count} experts "
            "('num_local_experts')"
        )
    group_size, per_rank = world_size // expert_parallel, experts.count // expert_parallel
    dense = [(name, shape) for name, shape in shapes if expert_index(name) is None]
    expert_network = replace(network, intra_node_ranks=max(1, network.intra_node_ranks // expert_parallel))
    groups = []
    for ep_rank in range(expert_parallel):
        held = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        tensors = [(name, shape) for name, shape in shapes if expert_index(name) in held]
        report = plan_report(tensors, group_size, bucket_numel, split, optimizer, expert_network, element_bytes, False)
        groups.append({"expert_parallel_rank": ep_rank, "experts": list(held), **report})
    dense_report = plan_report(dense, world_size, bucket_numel, split, optimizer, network, element_bytes, False)
    owned = [
        dense_report["numel_per_rank"][r] + groups[r % expert_parallel]["numel_per_rank"][r // expert_parallel]
        for r in range(world_size)
    ]
    ideal = sum(owned) / world_size
    return {
        "world_size": world_size,
        "expert_parallel": expert_parallel,
        "expert_data_parallel": group_size,
        "experts": experts.count,
        "experts_per_token": experts.per_token,
        "experts_per_rank": per_rank,
        "total_numel": sum(owned),
        "dense": dense_report,
        "expert_groups": groups,
        "owned_per_rank": owned,
        "owned_fullest_over_ideal": max(owned) / ideal if ideal else 1.0,
    }


def format_moe_report(report: dict[str, Any]) -> list[str]:
    n, ep, edp = report["world_size"], report["expert_parallel"], report["expert_data_parallel"]
    lines = [
        f"world size {n}, expert parallel {ep}: {report['experts']} experts per layer ({report['experts_per_token']} "
        f"per token), {report['experts_per_rank']} per expert-parallel rank; {report['total_numel']:,} elements, "
        f"{report['total_numel'] / n:,.0f} per rank ideally",
        f"  tensors outside the experts, over the data-parallel group ({n} ranks):",
    ]
    lines += ["  " + line for line in format_report(report["dense"])]
    lines.append(f"  expert tensors, each expert-parallel rank's over its expert-data-parallel group ({edp} ranks):")
    for group in report["expert_groups"]:
        e = group["expert_parallel_rank"]
        members = ", ".join(str(r) for r in range(e, n, ep)) if edp <= 4 else f"{e}, {e + ep}, ..., {n - ep + e}"
        held = group["experts"]
        which = f"expert {held[0]}" if len(held) == 1 else f"experts {held[0]}-{held[-1]}"
        lines.append(
            f"    {which} (ranks {members}): {group['tensors']} tensors, {group['total_numel']:,} elements; "
            f"fullest rank / ideal {group['imbalance']:.4f} (whole tensors only: {group['never_imbalance']:.4f}); "
            f"split {len(group['split'])}; buckets {group['buckets']}; sent {group['wire_ratio']:.4f} x a ring "
            "all-reduce"
        )
    owned = report["owned_per_rank"]
    lines.append(
        f"  per rank, both together: fullest {max(owned):,} elements / ideal {report['total_numel'] / n:,.0f} = "
        f"{report['owned_fullest_over_ideal']:.4f}"
    )
    return lines
