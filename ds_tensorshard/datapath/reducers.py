"""Reducers: one per domain (:mod:`~ds_tensorshard.datapath.domains`), fed by the gradient hooks, laying out its
buckets as the layout says (windows or stripes, :mod:`~ds_tensorshard.datapath.defaults`) and delivering this
rank's reduced segments: to its owned gradients, or to ZeRO-Offload's early updates."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ds_tensorshard.datapath.buckets import Bucket, build_buckets, build_stripes
from ds_tensorshard.datapath.defaults import LayoutChoice
from ds_tensorshard.datapath.domains import DENSE, Domain
from ds_tensorshard.datapath.early_update import EarlyUpdate
from ds_tensorshard.datapath.intake import GradientIntake
from ds_tensorshard.datapath.reduce import Averaging, OverlappedReducer
from ds_tensorshard.datapath.update import OwnedShard


def reductions_done(domains: dict[str, Domain]) -> tuple[int, int]:
    """(reductions of this backward completed, buckets) in the data-parallel domain: where an early update began."""
    reducer = domains[DENSE].reducer
    return reducer.started - len(reducer.in_flight), len(reducer.buckets)


def all_buckets(domains: dict[str, Domain]) -> list[Bucket]:
    """Every domain's buckets, as they are now."""
    return [bucket for domain in domains.values() for bucket in domain.reducer.buckets]


def _accept(shard: OwnedShard, rank: int, bucket: Bucket, segment: torch.Tensor) -> None:
    """A reduced segment arrived at its owner, this ``rank`` of the bucket's domain."""
    shard.accept(bucket, segment, rank)


def start_reducers(
    domains: dict[str, Domain],
    layout: LayoutChoice,
    comm_dtype_of: Callable[[torch.nn.Parameter], torch.dtype | None],
    averaging: Averaging,
    shard: OwnedShard,
    early: EarlyUpdate | None,
    intake: GradientIntake,
    names: dict[torch.nn.Parameter, str],
    step_of: Callable[[], int],
    boundary_of: Callable[[], int | None],
) -> None:
    """Give each domain its reducer, its first buckets in the reverse of model order (backward's, roughly)."""

    # the dtypes as planned: rebuilt after the first backward, the buckets keep them where a module cast a
    # parameter in forward (its gradient travels in the planned dtype, as stock's bucket is chosen by the config)
    planned = {param: param.dtype for domain in domains.values() for param in domain.params}

    def build(domain: Domain, backward_order: list[torch.nn.Parameter]) -> list[Bucket]:
        blocks_of, numel, dtype_of = domain.plan.blocks_of, layout.bucket_numel, planned.__getitem__
        if layout.layout in ("stripes", "flat"):  # flat parameters: reduced by stripes
            n = domain.comm.world_size
            routes = layout.routes(n).of
            buckets = build_stripes(backward_order, blocks_of, numel, n, comm_dtype_of, routes, dtype_of)
        else:
            buckets = build_buckets(backward_order, blocks_of, numel, comm_dtype_of, dtype_of)
        if early is not None:
            early.expect(buckets)
        return buckets

    for domain in domains.values():
        if domain.flat is not None:
            storage = domain.flat.storage
            routes = layout.routes(domain.comm.world_size)
            domain.flat.by_all_reduce = routes.of(storage.numel() * storage.element_size())[1]
        domain.reducer = OverlappedReducer(
            build(domain, list(reversed(domain.params))),
            domain.comm,
            averaging,
            early.deliver if early else functools.partial(_accept, shard, domain.comm.rank),
            domain.params,
            names.__getitem__,
            functools.partial(build, domain),
            intake.gradient_of,
            intake.release,
            step_of,
            boundary_of,
        )
        # added into the owned gradients before deliver returns, unless ZeRO-Offload stages it to the host
        domain.reducer.copy_segments = early is not None or shard.grads.host is not None
