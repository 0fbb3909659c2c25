"""Communication per step at ZeRO stage 3, by the α-β model of :mod:`.cost_model`: stock ZeRO-3's against
ds_tensorshard's (parameters owned whole, or in dim-0 blocks), and the choices a run on accelerators makes by it.

Both run DeepSpeed 0.19.8's ``PartitionedParameterCoordinator`` unchanged, so both gather the same batches:
:func:`fetch_batches` replays it over a module trace (:func:`module_trace`) with its stock bounds
(``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
``stage3_param_persistence_threshold``). What differs is the collective per batch:

- stock ZeRO-3: one all-gather per batch of ``n x sum(ceil(numel / n))`` elements (``_all_gather_dtype``);
  gradients reduce-scattered in buckets of ``reduce_bucket_size`` (``reduce_scatter_coalesced``, each tensor
  padded to ``n``); after the step one all-gather per persistent parameter (``_allgather_params_coalesced``);
- ds_tensorshard as :mod:`~ds_tensorshard.parameters.gather` issues it, on both transports: per batch a rooted
  broadcast per owner present (``"per_owner"``, what CPU ranks run), or on accelerators the route
  :func:`gather_route` chooses (a broadcast per owner, one all-reduce of the batch, or one all-gather of slots
  as wide as the widest owner's span); the persistent parameters as one batch after the step; gradients reduced
  as at stage 2 by the default stripes' reduce-scatters alone (no gather after the step).

A whole tensor leaves its one owner: ``S / B`` at the owner's link where stock's all-gather moves
``(n - 1) / n x S / B`` from each rank, and the all-reduce route ``2 S`` on a slow fabric. So where gathers are
bandwidth-bound, a stage-3 plan on accelerators cuts the large tensors into a block of rows on every rank
(:func:`cut_wanted`), and their batches go by all-gather, stock's own collective. A run cannot know its fabric:
both choices are priced on each of :data:`~ds_tensorshard.datapath.cost_model.FABRICS` and the one whose ratio to
stock's is lowest where it is highest is taken.

The trace is an approximation: the modules that hold parameters, in registration order forward and in reverse
backward; container modules (which hold none, but whose hooks also prefetch) and tied reuses are left out.
Stock and ds_tensorshard are priced on the same trace, so the ratio does not depend on it much.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ds_tensorshard.datapath.cost_model import (
    FABRICS,
    Cost,
    Network,
    Time,
    all_gather,
    all_reduce,
    cost_of,
    padded_bytes,
    rooted,
    stock_zero3_reduction,
)
from ds_tensorshard.datapath.plan import Block

STOCK_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size
STOCK_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters
STOCK_MAX_REUSE = 1_000_000_000  # stage3_max_reuse_distance
STOCK_PERSISTENCE = 100_000  # stage3_param_persistence_threshold


@dataclass(frozen=True)
class Stage3Bounds:
    """The coordinator's bounds, in elements (stock's defaults)."""

    prefetch_bucket: int = STOCK_PREFETCH_BUCKET
    max_live: int = STOCK_MAX_LIVE
    max_reuse: int = STOCK_MAX_REUSE
    persistence: int = STOCK_PERSISTENCE


def module_trace(names: Sequence[str]) -> list[list[int]]:
    """One step's modules as indices into ``names``: each parameter's module (its name's prefix) in order of
    first appearance, then the same modules in reverse (backward)."""
    modules: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        modules.setdefault(name.rpartition(".")[0], []).append(index)
    forward = list(modules.values())
    return forward + forward[::-1]


def persistent_of(numels: Sequence[int], threshold: int) -> list[int]:
    """The parameters every rank keeps gathered: those of at most ``threshold`` elements (stock's rule)."""
    return [i for i, numel in enumerate(numels) if numel <= threshold]


class _Reuse:
    """Whether a parameter recurs within ``max_reuse`` elements of traced modules from a step on (stock's test
    before a release), by prefix sums of the modules' sizes."""

    def __init__(self, trace: Sequence[Sequence[int]], numels: Sequence[int], max_reuse: int) -> None:
        self.prefix = [0]
        self.uses: dict[int, list[int]] = {}
        for step, params in enumerate(trace):
            self.prefix.append(self.prefix[-1] + sum(numels[p] for p in params))
            for p in params:
                self.uses.setdefault(p, []).append(step)
        self.max_reuse = max_reuse

    def within(self, param: int, step: int) -> bool:
        # modules step..last are scanned, each while fewer than max_reuse elements were traversed before it
        last = bisect.bisect_left(self.prefix, self.prefix[step] + self.max_reuse) - 1
        uses = self.uses[param]
        at = bisect.bisect_left(uses, step)
        return at < len(uses) and uses[at] <= last


def fetch_batches(
    numels: Sequence[int], trace: Sequence[Sequence[int]], bounds: Stage3Bounds = Stage3Bounds()
) -> list[list[int]]:
    """The batches one step gathers once the trace is recorded (persistent parameters gathered already): per
    module, its parameters not available, then the prefetch of the next ones in the trace; after the module, the
    release of those not persistent and not reused within ``max_reuse`` elements."""
    persistent = set(persistent_of(numels, bounds.persistence))
    queue = deque((p, step) for step, params in enumerate(trace) for p in sorted(params))
    reuse = _Reuse(trace, numels, bounds.max_reuse)
    available, latest = set(persistent), dict.fromkeys(range(len(numels)), -math.inf)
    batches: list[list[int]] = []
    live = 0
    for step, params in enumerate(trace):
        wanted = sorted(p for p in params if p not in available)
        if wanted:
            batches.append(wanted)
            available.update(wanted)
            live += sum(numels[p] for p in wanted)
        pending, popped = {p for p in params if latest[p] < step}, set[int]()
        while queue and len(popped) < len(pending):
            p, used_at = queue.popleft()
            latest[p] = used_at
            popped.add(p)
        limit, prefetch, numel = min(bounds.max_live - live, bounds.prefetch_bucket), [], 0
        while queue and numel < limit:
            p, used_at = queue.popleft()
            latest[p] = max(latest[p], used_at)
            if p not in available:
                prefetch.append(p)
                available.add(p)
                numel += numels[p]
        if prefetch:
            batches.append(sorted(prefetch))
            live += numel
        for p in params:
            if p not in persistent and latest[p] <= step + 1 and not reuse.within(p, step + 1):
                if p in available:
                    available.discard(p)
                    live -= numels[p]
    return batches


def stock_zero3_cost(
    numels: Sequence[int],
    batches: Sequence[Sequence[int]],
    n: int,
    net: Network,
    element_bytes: int,
    bounds: Stage3Bounds = Stage3Bounds(),
    reduce_bucket: int = 500_000_000,
) -> Cost:
    """Stock ZeRO-3 per step: an all-gather per batch, a reduce-scatter per gradient bucket, the norm, and an
    all-gather per persistent parameter after the step."""
    if n == 1:
        return Cost(0, 0.0, 0.0)
    gathers = [all_gather(padded_bytes(numels, batch, n, element_bytes), n, net) for batch in batches]
    persistent = [
        all_gather(padded_bytes(numels, [p], n, element_bytes), n, net)
        for p in persistent_of(numels, bounds.persistence)
    ]
    return cost_of([*gathers, *persistent]) + stock_zero3_reduction(numels, n, reduce_bucket, net, element_bytes)


GatherRoute = Literal["broadcasts", "all_reduce", "all_gather"]
ROUTES: tuple[GatherRoute, ...] = ("broadcasts", "all_reduce", "all_gather")


def route_times(route: GatherRoute, spans: Sequence[int], n: int, net: Network) -> list[Time]:
    """A batch's gather whose owners hold ``spans`` bytes: a broadcast from each owner; one all-reduce of the
    batch (every other span -0.0: exact); or one all-gather, every rank's span padded to the widest."""
    if route == "broadcasts":
        return [rooted(span, n, net) for span in spans]
    if route == "all_reduce":
        return [all_reduce(sum(spans), n, net)]
    return [all_gather(n * max(spans), n, net)]


def worst_ratio(ours: Callable[[Network], Sequence[Time]], stock: Callable[[Network], Sequence[Time]]) -> float:
    """The largest, over :data:`FABRICS`, of the time of the collectives ``ours(net)`` over stock ZeRO-3's
    ``stock(net)`` (a run cannot know its fabric: its choices hold on each)."""
    return max(sum(map(sum, ours(net))) / sum(map(sum, stock(net))) for net in FABRICS)


def gather_route(spans: Sequence[int], stock_bytes: int, n: int) -> GatherRoute:
    """The route of a batch whose owners hold ``spans`` bytes (stock's all-gather of it: ``stock_bytes``) on
    accelerators: the one furthest below stock's on the fabric where it fares worst (ties: the earlier of
    :data:`ROUTES`). One rank (``offload_param`` copies its tensors in) has no collective to price: broadcasts."""
    if n == 1:
        return ROUTES[0]
    stock = lambda net: [all_gather(stock_bytes, n, net)]  # noqa: E731
    return min(ROUTES, key=lambda route: worst_ratio(functools.partial(route_times, route, spans, n), stock))


def cut_wanted(shapes: Sequence[Sequence[int]], n: int, element_bytes: int) -> bool:
    """Whether the tensors of ``shapes`` (each of at least ``n`` rows) are gathered faster in one block of whole
    rows on every rank (all-gathered, padded to the widest block) than whole from one owner (by broadcast or by
    the all-reduce, the same route for all), each gathered alone once, on the fabric where each way fares worst
    against stock ZeRO-3's all-gather of each."""
    if n < 2 or not shapes:
        return False
    numels = [math.prod(shape) for shape in shapes]
    widest = [-(-shape[0] // n) * (numel // shape[0]) * element_bytes for shape, numel in zip(shapes, numels)]

    def times(route: GatherRoute, net: Network) -> list[Time]:
        if route == "all_gather":
            return [all_gather(n * width, n, net) for width in widest]
        return [t for numel in numels for t in route_times(route, [numel * element_bytes], n, net)]

    def stock(net: Network) -> list[Time]:
        return [all_gather(padded_bytes(numels, [i], n, element_bytes), n, net) for i in range(len(numels))]

    worst = {route: worst_ratio(functools.partial(times, route), stock) for route in ROUTES}
    return worst["all_gather"] <= min(worst["broadcasts"], worst["all_reduce"])


def tensorshard_gathers(
    blocks: Sequence[Sequence[Block]],
    numels: Sequence[int],
    batches: Sequence[Sequence[int]],
    n: int,
    net: Network,
    element_bytes: int,
    route: str = "default",
) -> list[Time]:
    """ds_tensorshard's gathers of ``batches`` (each parameter's ``blocks``). ``route``: ``"per_owner"``, one
    broadcast per owner present (what CPU ranks run); ``"default"``, the route :func:`gather_route` chooses (what
    runs on accelerators)."""
    if n == 1:
        return []
    times: list[Time] = []
    for batch, spans in zip(batches, batch_spans(blocks, batches, element_bytes)):
        stock_bytes = padded_bytes(numels, batch, n, element_bytes)
        chosen: GatherRoute = gather_route(spans, stock_bytes, n) if route == "default" else "broadcasts"
        times += route_times(chosen, spans, n, net)
    return times


def batch_spans(
    blocks: Sequence[Sequence[Block]], batches: Sequence[Sequence[int]], element_bytes: int
) -> list[list[int]]:
    """Per batch, the bytes each owner present holds of it (the spans of
    :class:`~ds_tensorshard.parameters.gather.GatherLayout`)."""
    result = []
    for batch in batches:
        owned: dict[int, int] = {}
        for p in batch:
            for block in blocks[p]:
                owned[block.rank] = owned.get(block.rank, 0) + block.numel * element_bytes
        result.append(list(owned.values()))
    return result


def tensorshard_zero3_cost(
    blocks: Sequence[Sequence[Block]],
    numels: Sequence[int],
    batches: Sequence[Sequence[int]],
    n: int,
    net: Network,
    element_bytes: int,
    reduction: Callable[[], Cost],
    route: str = "default",
    bounds: Stage3Bounds = Stage3Bounds(),
) -> Cost:
    """ds_tensorshard per step: the gathers of ``batches`` and of the persistent parameters after the step, and
    ``reduction`` (the gradients' reduction and the norm, as at stage 2 without its gather)."""
    persistent = persistent_of(numels, bounds.persistence)
    every = [*batches, *([persistent] if persistent else [])]
    times = tensorshard_gathers(blocks, numels, every, n, net, element_bytes, route)
    return cost_of(times) + reduction()
