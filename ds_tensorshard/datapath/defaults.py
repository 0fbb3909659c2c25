"""The bucket layout and size a run takes: the config's keys where it sets them, else chosen for the transport,
the backend and the world size (``bucket_layout: "auto"``, the default).

- Explicit keys win: ``tensorshard.bucket_numel``, else ``zero_optimization.reduce_bucket_size``, is the bucket
  size; ``bucket_layout`` ``"windows"``, ``"stripes"`` or ``"flat"`` the layout. What they leave open is chosen as
  below, with the size they give where they give one.
- CPU ranks (gloo, MPI over CPU): the layout measured faster on CPUs (:func:`measured_on_cpu`: windows on the
  torch transport, on mpi windows below 4 ranks and stripes from 4; figures in ``docs/performance.md``), in
  buckets of ``DEFAULT_BUCKET_NUMEL`` (the size measured).
- Accelerators (NCCL and the like), more than one rank: flat parameters where nothing in the run rules them out
  (:mod:`.flat_choice` decides before the plan is made; ``flat_numel`` here), else stripes; either way stripes
  sized and routed by the α-β cost model (:mod:`.cost_model`, with flat parameters' one gather of their storage
  instead of a gather per stripe) on each of its ``FABRICS`` (a run cannot know its own): the most buckets whose
  predicted communication per step is at most ``TARGET`` x stock ZeRO-2's at its own defaults
  (``reduce_bucket_size`` 5e8) on every fabric, each flat buffer within those 5e8 elements; where no bucket size
  within them gets there, the fewest buckets they allow (the fastest), routed to the smaller worse ratio. The
  routes (:func:`route_candidates`) are priced with each size. Windows at the same size are never faster by the
  model (two launches per owner present against two per bucket), so they are not priced.
  At ZeRO stage 3 the stripes only reduce (the next forward gathers the parameters): the same rule against stock
  ZeRO-3's reduction (reduce-scatters of ``reduce_bucket_size`` buckets and the norm) instead.
  One rank communicates nothing: windows of ``DEFAULT_BUCKET_NUMEL``.
- Stripes travel by :class:`StripeRoutes`: each way one all-reduce of the whole stripe instead of the
  reduce-scatter / all-gather where chosen with the size (accelerators; a size set in the config, or another
  group's size, below the size the default network prices it faster) or where it measured faster (CPU ranks:
  :data:`ALL_REDUCE_ON_CPU_BELOW`).

The choice is made once, over the data-parallel group's tensors and plan; expert groups (MoE) take it too, their
stripes routed for their own size.

Worked example (the default network, 8 ranks in one node: 9.6 us per hop, 450 GB/s): eight tensors of 1e8 bf16
elements, one per rank. Stock ZeRO-2 all-reduces them in two buckets of 5e8 and 3e8 elements (4.02 + 2.47 ms),
all-gathers the 8e8 (3.18 ms) and all-reduces the norm (0.06 ms): 9.73 ms. K stripes take 6.22 ms on the wire,
2 x 67.2 us of latency each and the norm: 0.9 x 9.73 ms allows K = 18, so ``bucket_numel`` is
8 x ceil(1e8 / 18) = 44,444,448 (8.70 ms, 0.89x stock).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.cost_model import (
    DEFAULT_NETWORK,
    FABRICS,
    STOCK_REDUCE_BUCKET,
    Network,
    all_reduce_below,
    most_stripes,
    stock_zero2_cost,
    stock_zero3_reduction,
    tensorshard_stripes_cost,
)
from ds_tensorshard.datapath.shapes import numel_of
from ds_tensorshard.transports.host_shared import HostSharedComm

if TYPE_CHECKING:
    from ds_tensorshard.datapath.domains import Domain

DEFAULT_BUCKET_NUMEL = 4_000_000  # elements: windows' size, and CPU ranks' (two buckets in flight cost little memory)
TARGET = 0.9  # stripes on accelerators: the most buckets whose predicted time is at most this x stock ZeRO-2's
# On CPU ranks, the fewest ranks from which stripes measured faster than windows, per comm_backend (None: windows
# at every size measured); "ds-tensorshard bench --configs ts_torch_windows ts_torch_stripes ts_mpi_windows
# ts_mpi_stripes" at 2 and 4 ranks, 6 runs each (docs/performance.md, "Bucket layout on CPU ranks, measured")
STRIPES_ON_CPU_FROM: dict[str, int | None] = {"torch": None, "mpi": 4}
# On CPU ranks, below how many ranks a stripe measured faster as one all-reduce than as a reduce-scatter / an
# all-gather, per comm_backend and direction: gloo's all-reduce beat its reduce-scatter at 2, 3 and 4 ranks
# (1.2-2.5x, 4M and 16M fp32 elements) and its all-gather at 2 only; MPI's Ireduce_scatter_block and Iallgather
# are kept (docs/performance.md, "Stripes by all-reduce")
ALL_REDUCE_ON_CPU_BELOW: dict[str, tuple[float, int]] = {"torch": (math.inf, 3), "mpi": (0, 0)}
Layout = Literal["windows", "stripes", "flat"]
FLAT_WHY = "flat: the parameters laid in one storage (an accelerator, and nothing in the run rules it out)"
FLAT_SHARED_WHY = (
    "flat: the parameters laid in one storage that the ranks of this host share (CPU ranks through shared memory, "
    "and nothing in the run rules it out)"
)


@dataclass(frozen=True)
class StripeRoutes:
    """Which of a stripe's two collectives travel as one all-reduce of the whole stripe instead of a reduce-scatter
    (``reduce_below``) or an all-gather (``gather_below``): those of stripes smaller than that many bytes."""

    reduce_below: float = 0.0
    gather_below: float = 0.0

    def of(self, nbytes: int) -> tuple[bool, bool]:
        """(reduce by all-reduce, gather by all-reduce) for a stripe of ``nbytes``."""
        return nbytes < self.reduce_below, nbytes < self.gather_below

    @classmethod
    def for_wire(cls, wire: Wire, world_size: int) -> StripeRoutes:
        """CPU ranks: as measured (:data:`ALL_REDUCE_ON_CPU_BELOW`), but through shared memory never (there a
        reduce-scatter and an all-gather copy each byte once, an all-reduce every rank's whole stripe); accelerators:
        by the cost model on its default network (:func:`~ds_tensorshard.datapath.cost_model.all_reduce_below`, the
        same size both ways)."""
        if wire.shared_memory:
            return cls()
        if wire.on_cpu:
            reduce_ranks, gather_ranks = ALL_REDUCE_ON_CPU_BELOW[wire.comm_backend]
            return cls(math.inf if world_size < reduce_ranks else 0.0, math.inf if world_size < gather_ranks else 0.0)
        below = all_reduce_below(world_size, DEFAULT_NETWORK)
        return cls(below, below)

    def describe(self, flat: bool = False) -> str:
        """In words, for the start-up line (``flat``: the parameters gathered as one flat storage instead)."""
        parts = [
            "all-reduce" + ("" if limit == math.inf else f" below {limit / 2**20:,.1f} MiB, else {ring}")
            if limit
            else ring
            for limit, ring in ((self.reduce_below, "reduce-scatter"), (self.gather_below, "all-gather"))
        ]
        if flat:
            return f"reduced by {parts[0]}, the flat parameter storage gathered in place by {parts[1]}"
        return f"reduced by {parts[0]}, gathered by {parts[1]}"


def measured_on_cpu(comm_backend: str, world_size: int) -> Layout:
    """The layout measured faster on CPU ranks for this transport at this world size."""
    fewest = STRIPES_ON_CPU_FROM[comm_backend]
    return "stripes" if fewest is not None and world_size >= fewest else "windows"


@dataclass(frozen=True)
class LayoutChoice:
    """The buckets' layout and size, and why (the start-up log line says it)."""

    layout: Layout
    bucket_numel: int
    why: str
    wire: Wire | None = None
    """Stripes only: where they travel, which sets their routes."""
    priced: tuple[int, StripeRoutes] | None = None
    """Stripes sized by the cost model: the world size they were priced at and the routes chosen with the size."""

    def routes(self, world_size: int) -> StripeRoutes:
        """Which collectives of stripes over a group of ``world_size`` ranks travel as all-reduces: those priced
        with the size at its world size, else (an MoE expert group's own size, a size set in the config) by
        :meth:`StripeRoutes.for_wire`; none for windows."""
        if self.wire is None:
            return StripeRoutes()
        if self.priced is not None and self.priced[0] == world_size:
            return self.priced[1]
        return StripeRoutes.for_wire(self.wire, world_size)


@dataclass(frozen=True)
class Wire:
    """Where the buckets travel: ``comm_backend``, the transport's name (``"torch (nccl)"``, ``"mpi"``), whether
    the ranks are CPUs, whether they share memory."""

    comm_backend: str
    transport: str
    on_cpu: bool
    shared_memory: bool = False
    """CPU ranks of one host through the shared-memory lane (:mod:`~ds_tensorshard.transports.host_shared`)."""


# where ``ds-tensorshard plan`` prices the default a run on an accelerator would take
ACCELERATOR = Wire("torch", "an accelerator", on_cpu=False)


def requested_bucket_numel(config: TensorShardConfig, param_dict: Mapping[str, Any]) -> tuple[int | None, str]:
    """The bucket size the config sets and the key that sets it: ``tensorshard.bucket_numel``, else a
    ``zero_optimization.reduce_bucket_size`` that is a positive number; (None, "") where neither does."""
    if config.bucket_numel is not None:
        return config.bucket_numel, "tensorshard.bucket_numel"
    size = (param_dict.get("zero_optimization", {}) or {}).get("reduce_bucket_size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0:
        return int(size), "zero_optimization.reduce_bucket_size"
    return None, ""


def layout_for(
    config: TensorShardConfig, param_dict: Mapping[str, Any], domain: Domain, on_cpu: bool, dtype: torch.dtype
) -> LayoutChoice:
    """:func:`choose_layout` for a run's data-parallel ``domain`` (its transport, tensors and plan), with
    gradients of ``dtype``."""
    owned = [0] * domain.comm.world_size
    for param in domain.params:
        for block in domain.plan.blocks_of(param):
            owned[block.rank] += block.numel
    wire = Wire(config.comm_backend, domain.comm.name, on_cpu, isinstance(domain.comm, HostSharedComm))
    numels, flat_numel = [numel_of(p) for p in domain.params], domain.plan.flat_slot * domain.comm.world_size
    return choose_layout(config, param_dict, wire, numels, owned, dtype.itemsize, flat_numel)


def choose_layout(
    config: TensorShardConfig,
    param_dict: Mapping[str, Any],
    wire: Wire,
    numels: Sequence[int],
    owned: Sequence[int],
    element_bytes: int,
    flat_numel: int = 0,
) -> LayoutChoice:
    """The layout and bucket size of a run whose data-parallel group has ranks owning ``owned`` elements each, of
    tensors of ``numels`` elements (registration order), gradients of ``element_bytes`` on the wire; stripes with
    their wire, which routes their collectives (:meth:`LayoutChoice.routes`). ``flat_numel``: the parameters are
    flat (:mod:`~ds_tensorshard.datapath.flat_choice` chose it), in a storage of that many elements: stripes
    reduce, one collective of the storage (routed as a stripe's gather) gathers."""
    size, size_key = requested_bucket_numel(config, param_dict)
    layout = None if config.bucket_layout == "auto" else config.bucket_layout
    n = len(owned)
    choice = functools.partial(_routed, wire=wire, world_size=n)
    if flat_numel:
        given = f"{size_key} {size:,} set in the config" if size is not None else ""
        why = "bucket_layout set in the config" if layout else FLAT_SHARED_WHY if wire.shared_memory else FLAT_WHY
        if size is None and wire.on_cpu:  # asked for on CPU ranks: the bucket size measured there
            size = DEFAULT_BUCKET_NUMEL
        elif size is None:
            size, routes, sized = default_stripes(numels, owned, element_bytes, flat_numel)
            return choice("flat", size, f"{why}; {sized}", routes=routes)
        return choice("flat", size, "; ".join(filter(None, (why, given))))
    if layout is not None and size is not None:
        return choice(layout, size, f"bucket_layout and {size_key} set in the config")
    given = f"{size_key} {size:,} set in the config" if size is not None else ""
    if wire.on_cpu:
        chosen = layout or measured_on_cpu(wire.comm_backend, n)
        other = "stripes" if chosen == "windows" else "windows"
        why = "bucket_layout set in the config" if layout else f"{chosen}: measured faster than {other} on CPU ranks"
        why += f" ({wire.transport} at {n} rank{'s' if n != 1 else ''})"
        return choice(chosen, size or DEFAULT_BUCKET_NUMEL, "; ".join(filter(None, (why, given))))
    if n == 1 or layout == "windows":
        why = "one rank: nothing is communicated" if n == 1 else "bucket_layout set in the config"
        return choice(layout or "windows", size or DEFAULT_BUCKET_NUMEL, "; ".join(filter(None, (why, given))))
    if size is not None:
        return choice(
            "stripes",
            size,
            f"{given}; stripes: on {wire.transport} at {n} ranks the cost model "
            "prices them below windows at any bucket size",
        )
    stage3 = (param_dict.get("zero_optimization") or {}).get("stage") == 3
    bucket, routes, why = default_stripes(numels, owned, element_bytes, stage3=stage3)
    return choice("stripes", bucket, f"{'bucket_layout set in the config; ' if layout else ''}{why}", routes=routes)


def _routed(
    layout: Layout, bucket_numel: int, why: str, wire: Wire, world_size: int, routes: StripeRoutes | None = None
) -> LayoutChoice:
    """The choice; stripes (flat's too) keep their wire and ``routes`` (priced with the size; else the wire's), and
    the reason says how they travel at ``world_size`` ranks."""
    if layout == "windows":
        return LayoutChoice(layout, bucket_numel, why)
    priced = None if routes is None else (world_size, routes)
    routes = routes or StripeRoutes.for_wire(wire, world_size)
    how = routes.describe(layout == "flat")
    if layout == "flat" and wire.shared_memory:
        how = "reduced by reduce-scatter, the flat parameter storage shared (its gather a barrier)"
    return LayoutChoice(layout, bucket_numel, f"{why}; {how}", wire, priced)


def route_candidates(n: int) -> list[StripeRoutes]:
    """The routes priced at ``n`` ranks, each way: all-reduce below the size the model prices faster on the default
    network (first: it wins ties), never, below that size on the slow fabric, always."""
    limits = dict.fromkeys((all_reduce_below(n, DEFAULT_NETWORK), 0.0, all_reduce_below(n, FABRICS[-1]), math.inf))
    return [StripeRoutes(reduce, gather) for reduce in limits for gather in limits]


def default_stripes(
    numels: Sequence[int], owned: Sequence[int], element_bytes: int, flat_numel: int = 0, stage3: bool = False
) -> tuple[int, StripeRoutes, str]:
    """The stripes' bucket size on an accelerator and their routes (the rule in the module's docstring; ``flat_numel``:
    the flat parameters' storage, gathered whole; ``stage3``: the reductions alone, against stock ZeRO-3's) and the
    reason, in words."""
    n, fullest = len(owned), max(owned)
    stock_cost = stock_zero3_reduction if stage3 else stock_zero2_cost
    stocks = [stock_cost(numels, n, STOCK_REDUCE_BUCKET, net, element_bytes).seconds for net in FABRICS]

    def ratios(bucket: int, routes: StripeRoutes) -> list[float]:
        under = (routes.reduce_below, routes.gather_below)
        costs = [
            tensorshard_stripes_cost(fullest, n, bucket, net, element_bytes, under, flat_numel, gather=not stage3)
            for net in FABRICS
        ]
        return [cost.seconds / stock if stock else 1.0 for cost, stock in zip(costs, stocks)]

    priced = []
    for routes in route_candidates(n):
        fits = functools.partial(lambda size, way: max(ratios(size, way)) <= TARGET, way=routes)
        bucket = most_stripes(fullest, n, STOCK_REDUCE_BUCKET, fits)
        priced.append((bucket, max(ratios(bucket, routes)), routes))
    within = [choice for choice in priced if choice[1] <= TARGET]
    bucket, _, routes = min(within or priced, key=lambda choice: choice[:2])  # the most buckets, then fastest
    against = "stock ZeRO-3's reduction" if stage3 else "stock ZeRO-2's communication"
    rule = (
        f"the most buckets predicted within {TARGET}x {against} at its defaults"
        if within
        else f"the fewest buckets (the fastest) with flat buffers within stock's {STOCK_REDUCE_BUCKET:,}-element "
        f"bucket; none there is predicted within {TARGET}x {against} at its defaults"
    )
    each = "; ".join(
        f"{describe(net)}: {ratio:.2f}x of {stock * 1e3:,.1f} ms"
        for net, ratio, stock in zip(FABRICS, ratios(bucket, routes), stocks)
    )
    return (
        bucket,
        routes,
        (
            f"stripes, {-(-fullest // max(1, bucket // n))} buckets at {n} ranks: {rule} on each fabric the cost model "
            f"prices ({each})"
        ),
    )


def describe(net: Network) -> str:
    return (
        f"{net.alpha_us} us per hop, {net.bus_gbps} GB/s across {net.intra_node_ranks}-rank nodes, "
        f"{net.intra_gbps} GB/s within"
    )
