"""Communication per step before launching: ds_tensorshard's collectives against stock ZeRO-2's, by the α-β model.

Every collective costs ``hops x alpha + bytes x factor / B`` (the formulas are in ``docs/performance.md``):
``alpha`` the latency of one hop, ``B`` the bus bandwidth as nccl-tests defines it (``doc/PERFORMANCE.md``),
the NVLink figure while the world fits in one node, the network's beyond. Collectives are counted one after
another, none overlapped with compute or with each other, except those one launch groups together.

Three patterns per step, each with one scalar all-reduce for the gradient norm:

- ``tensorshard_per_owner``: a reduce to each owner present in a bucket, then a broadcast from each (the torch
  transport on gloo, which groups nothing);
- ``tensorshard_grouped``: the same collectives, one launch per bucket and direction (a reduce-scatter
  and an all-gather with per-rank counts, or NCCL group calls: one chain latency, the bucket's bytes; built so
  far only for the reduction, the mpi transport's ``Ireduce_scatter``);
- ``tensorshard_stripes``: ``bucket_layout: "stripes"``, per bucket over every rank's slot (padded to the
  fullest rank's) one reduce-scatter and one all-gather, or in either direction one all-reduce of the whole
  bucket where the model prices that faster (:func:`stripe_collective`); :func:`stripes_fit` gives the bucket
  size with the most buckets (the smallest flat buffers) whose time stays within a limit
  (``datapath/defaults.py`` sets it);
- ``stock_zero2``: DeepSpeed 0.19.8's ``stage_1_and_2.py`` at its defaults (``reduce_scatter`` and
  ``use_multi_rank_bucket_allreduce`` true): the gradients of whole parameters fill a bucket up to
  ``reduce_bucket_size`` (one larger than that is its own bucket), each bucket is cut at the partition
  boundaries and all-reduced in chunks that close once past ``reduce_bucket_size`` (``allreduce_and_scatter``);
  after the step one ``all_gather_into_tensor`` of the whole flat group, padded to ``2 x world`` elements.
  With ``use_multi_rank_bucket_allreduce`` false (``stock_zero2_reduce``) each partition present in a bucket
  gets its own reduce instead (``allreduce_no_retain``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.errors import PlanError

STOCK_ALIGNMENT = 2  # stage_1_and_2.py: nccl_start_alignment_factor, the flat group padded to this x world size
STOCK_REDUCE_BUCKET = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default, in elements


@dataclass(frozen=True)
class Network:
    """Per-hop latency, bus bandwidth across nodes, ranks per node and bus bandwidth within one."""

    alpha_us: float
    bus_gbps: float
    intra_node_ranks: int = 8
    intra_gbps: float = 450.0

    def bandwidth(self, world_size: int) -> float:
        """Bytes per second of the hardware bottleneck: NVLink within one node, the network beyond."""
        return (self.intra_gbps if world_size <= self.intra_node_ranks else self.bus_gbps) * 1e9

    @property
    def alpha(self) -> float:
        return self.alpha_us * 1e-6


# 8 H100 per node, NVLink 4 (450 GB/s per direction per GPU) within, 8 ConnectX-7 NDR (8 x 400 Gb/s = 400 GB/s
# per node) across; 9.6 us per network hop: NCCL's own tuning model (src/graph/tuning.cc, hwLat NET, Ring, Simple)
DEFAULT_NETWORK = Network(alpha_us=9.6, bus_gbps=400.0, intra_node_ranks=8, intra_gbps=450.0)
# A slower fabric between the same nodes: 25 GB/s per node (one 200 Gb/s NIC), 5 us per hop ("--network 5,25")
SLOW_NETWORK = Network(alpha_us=5.0, bus_gbps=25.0, intra_node_ranks=8, intra_gbps=450.0)
# The fabrics a default must hold on: a run cannot know its own, so the defaults are priced on each
FABRICS = (DEFAULT_NETWORK, SLOW_NETWORK)


def parse_network(text: str) -> Network:
    """``ALPHA_US,BUS_GBPS[,INTRA_NODE_RANKS,INTRA_GBPS]``; the last two default to 8 ranks and 450 GB/s."""
    fields = text.split(",")
    if len(fields) not in (2, 4):
        raise PlanError(f"--network takes ALPHA_US,BUS_GBPS[,INTRA_NODE_RANKS,INTRA_GBPS], got {text!r}")
    try:
        alpha, bus = float(fields[0]), float(fields[1])
        ranks, intra = (int(fields[2]), float(fields[3])) if len(fields) == 4 else (8, DEFAULT_NETWORK.intra_gbps)
    except ValueError:
        raise PlanError(f"--network takes numbers, got {text!r}") from None
    if alpha < 0 or bus <= 0 or ranks < 1 or intra <= 0:
        raise PlanError(f"--network needs alpha >= 0, bandwidths > 0 and at least one rank per node, got {text!r}")
    return Network(alpha, bus, ranks, intra)


# -- the α-β formulas (S: bytes, n: ranks), each as (latency, transfer) seconds; docs/performance.md states them --
Time = tuple[float, float]


def ring_all_reduce(size: float, n: int, net: Network) -> Time:
    return (2 * (n - 1) * net.alpha, 2 * (n - 1) / n * size / net.bandwidth(n)) if n > 1 else (0.0, 0.0)


def tree_all_reduce(size: float, n: int, net: Network) -> Time:
    """NCCL's double binary tree: a reduce up and a broadcast down, 2 log2(n) hops, 2 S over the bus."""
    return (2 * math.ceil(math.log2(n)) * net.alpha, 2 * size / net.bandwidth(n)) if n > 1 else (0.0, 0.0)


def all_reduce(size: float, n: int, net: Network) -> Time:
    """The faster of ring and tree, as NCCL's tuner picks."""
    return min(ring_all_reduce(size, n, net), tree_all_reduce(size, n, net), key=sum)


def all_gather(size: float, n: int, net: Network) -> Time:
    """Ring all-gather (or reduce-scatter) of ``size`` bytes in all."""
    return ((n - 1) * net.alpha, (n - 1) / n * size / net.bandwidth(n)) if n > 1 else (0.0, 0.0)


def stripe_collective(size: float, n: int, net: Network) -> Time:
    """One direction of a stripe of ``size`` bytes: its ring reduce-scatter (or all-gather), or one all-reduce of
    the whole stripe where that is faster (the tree's 2 log2(n) hops against the ring's n - 1, for twice the
    bytes: small stripes at many ranks; :func:`all_reduce_below`)."""
    return min(all_gather(size, n, net), all_reduce(size, n, net), key=sum)


def all_reduce_below(n: int, net: Network) -> float:
    """The stripe size in bytes under which :func:`stripe_collective` takes the all-reduce: where the tree's
    ``2 c alpha + 2 S / B`` (``c = ceil(log2 n)``) is below the ring's ``(n - 1) alpha + (n - 1) / n x S / B``,
    ``S < alpha B (n - 1 - 2 c) n / (n + 1)``; 0 where the ring is never slower (up to 7 ranks)."""
    if n < 2:
        return 0.0
    return max(0.0, net.alpha * net.bandwidth(n) * (n - 1 - 2 * math.ceil(math.log2(n))) * n / (n + 1))


def rooted(size: float, n: int, net: Network) -> Time:
    """A reduce to, or broadcast from, one rank: a pipelined chain over the ring (NCCL has no tree for these)."""
    return ((n - 1) * net.alpha, size / net.bandwidth(n)) if n > 1 else (0.0, 0.0)


@dataclass(frozen=True)
class Cost:
    """Collectives one rank launches per step and their predicted time, of which ``latency_s`` is hops."""

    launches: int
    seconds: float
    latency_s: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.launches + other.launches, self.seconds + other.seconds, self.latency_s + other.latency_s)


def cost_of(times: Sequence[Time]) -> Cost:
    """The cost of launching each of ``times``' collectives once."""
    return Cost(len(times), sum(map(sum, times)), sum(latency for latency, _ in times))


def padded_bytes(numels: Sequence[int], params: Iterable[int], n: int, element_bytes: int) -> int:
    """The bytes of stock ZeRO-3's flat buffer of ``params`` (indices into ``numels``), each tensor padded to
    ``n`` elements."""
    return sum(-(-numels[p] // n) * n for p in params) * element_bytes


def _norm(n: int, net: Network) -> Time:
    """The one scalar all-reduce of the gradient norm."""
    return all_reduce(4, n, net)


def per_owner_cost(buckets: Sequence[Bucket], n: int, net: Network, element_bytes: int) -> Cost:
    """Per bucket one reduce to each owner present, then one broadcast from each."""
    per_owner = [rooted(s.numel * element_bytes, n, net) for b in buckets for s in b.segments]
    return cost_of([*per_owner, *per_owner, _norm(n, net)])


def tensorshard_grouped_cost(buckets: Sequence[Bucket], n: int, net: Network, element_bytes: int) -> Cost:
    """One launch per bucket and direction: the bucket's rooted operations grouped, one chain's latency."""
    per_bucket = [rooted(b.numel * element_bytes, n, net) for b in buckets]
    return cost_of([*per_bucket, *per_bucket, _norm(n, net)])


def tensorshard_stripes_cost(
    fullest: int,
    n: int,
    bucket_numel: int,
    net: Network,
    element_bytes: int,
    all_reduce_under: tuple[float, float] | None = None,
    flat_numel: int = 0,
    gather: bool = True,
) -> Cost:
    """Stripes of ``bucket_numel`` over a fullest rank of ``fullest`` elements (``build_stripes``: slots of
    ``bucket_numel // n``, the last one the rest): each stripe's ``n x slot`` elements reduced and gathered by
    :func:`stripe_collective` (a ring reduce-scatter and all-gather, or all-reduces), counted in closed form (a
    small bucket at many ranks is many stripes). ``all_reduce_under``: the sizes in bytes under which a run
    reduces, and gathers, by all-reduce, where it chose its routes otherwise than on ``net``. ``flat_numel``: flat
    parameters (``bucket_layout: "flat"``), gathered instead by one collective (the same choice) of their storage of
    that many elements. ``gather=False``: the reductions alone (stage 3: the next forward gathers instead)."""
    slot = max(1, bucket_numel // n)
    full, rest = divmod(fullest, slot)

    def collective(size: float, way: int) -> Time:
        if all_reduce_under is None:
            return stripe_collective(size, n, net)
        return all_reduce(size, n, net) if size < all_reduce_under[way] else all_gather(size, n, net)

    ways = (0,) if flat_numel or not gather else (0, 1)
    stripes = ((full, slot), (int(rest > 0), rest))
    per = [(count, collective(n * width * element_bytes, way)) for count, width in stripes for way in ways]
    times = [_norm(n, net)] + ([collective(flat_numel * element_bytes, 1)] if flat_numel else [])
    return Cost(
        sum(count for count, _ in per) + len(times),
        sum(count * sum(time) for count, time in per) + sum(map(sum, times)),
        sum(count * time[0] for count, time in per) + sum(time[0] for time in times),
    )


def stripes_fit(
    fullest: int, n: int, net: Network, element_bytes: int, limit_s: float, max_numel: int, flat_numel: int = 0
) -> int:
    """The bucket size (``n x slot``, at most ``max_numel`` where a slot of one element allows it) of the most
    stripes over a fullest rank of ``fullest`` elements whose reduce-scatters and all-gathers (``flat_numel``: and
    the flat parameters' one gather of their storage) take at most ``limit_s``; where none does, the fewest stripes that
    ``max_numel`` allows (the fastest within it)."""
    return most_stripes(
        fullest,
        n,
        max_numel,
        lambda bucket: (
            tensorshard_stripes_cost(fullest, n, bucket, net, element_bytes, flat_numel=flat_numel).seconds <= limit_s
        ),
    )


def most_stripes(fullest: int, n: int, max_numel: int, fits: Callable[[int], bool]) -> int:
    """The bucket size (``n x slot``) of the most stripes over a fullest rank of ``fullest`` elements for which
    ``fits(bucket size)`` holds, searched as if it held up to some count and not beyond (time grows with the
    count); where none does, the fewest stripes that ``max_numel`` allows."""
    fewest = -(-fullest // max(1, max_numel // n)) if fullest else 1
    low, high = fewest, max(fullest, fewest)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(n * -(-fullest // middle)) else (low, middle - 1)
    return n * -(-max(fullest, 1) // low)


def stripes_padding(owned: Sequence[int], bucket_numel: int) -> tuple[int, int]:
    """Zeros in stripes of ``bucket_numel`` over ranks owning ``owned`` elements each (``build_stripes``, one
    dtype): (the most in one stripe's flat buffer, all stripes' together). A slot is ``bucket_numel // n``, the
    last stripe as wide as the fullest rank has left; rank ``r``'s part of stripe ``k`` is what it owns past
    ``k x slot``, up to the slot. Padding grows with ``k`` (ranks run out), so the most is in the last full
    stripe or in the narrower last one."""
    n, fullest = len(owned), max(owned, default=0)
    if not fullest:
        return 0, 0
    slot = max(1, bucket_numel // n)
    full, rest = divmod(fullest, slot)
    zeros = lambda start, width: sum(width - min(width, max(0, o - start)) for o in owned)  # noqa: E731
    largest = max(zeros((full - 1) * slot, slot) if full else 0, zeros(full * slot, rest) if rest else 0)
    return largest, n * fullest - sum(owned)


def stock_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Stock's gradient buckets: indices of whole parameters in backward (reverse registration) order, closed
    when the next would pass ``bucket_numel`` (``reduce_independent_p_g_buckets_and_remove_grads``)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(numels))):
        if numels[index] == 0:
            continue
        if current and filled + numels[index] > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numels[index]
    if current:
        buckets.append(current)
    return buckets


def _chunks(sizes: Iterable[int], limit: int) -> list[int]:
    """Stock's ``allreduce_and_scatter`` / ``allreduce_no_retain``: a chunk closes once its total passes ``limit``."""
    chunks, total = [], 0
    for size in sizes:
        total += size
        if total > limit:
            chunks.append(total)
            total = 0
    return chunks + ([total] if total else [])


def stock_zero3_reduction(numels: Sequence[int], n: int, bucket_numel: int, net: Network, element_bytes: int) -> Cost:
    """Stock ZeRO-3's gradient reduction per step: a reduce-scatter per bucket of ``bucket_numel``
    (``reduce_bucket_size``; each tensor padded to ``n``) and the norm."""
    if n == 1:
        return Cost(0, 0.0, 0.0)
    buckets = stock_buckets(list(numels), bucket_numel)
    return cost_of([*(all_gather(padded_bytes(numels, b, n, element_bytes), n, net) for b in buckets), _norm(n, net)])


def stock_zero2_cost(
    numels: Sequence[int], n: int, bucket_numel: int, net: Network, element_bytes: int, multi_rank: bool = True
) -> Cost:
    """Stock ZeRO-2's collectives per step over one parameter group (``numels`` in registration order)."""
    total = sum(numels)
    padded = -(-total // (STOCK_ALIGNMENT * n)) * STOCK_ALIGNMENT * n
    part = padded // n
    offsets = [0]
    for numel in numels:
        offsets.append(offsets[-1] + numel)
    times: list[Time] = []
    for bucket in stock_buckets(numels, bucket_numel):
        slices: list[tuple[int, int]] = []  # (partition, elements), consecutive same-partition ones merged
        for index in bucket:
            start, stop = offsets[index], offsets[index + 1]
            for partition in range(start // part, (stop - 1) // part + 1):
                numel = min(stop, (partition + 1) * part) - max(start, partition * part)
                if slices and slices[-1][0] == partition:
                    slices[-1] = (partition, slices[-1][1] + numel)
                else:
                    slices.append((partition, numel))
        if multi_rank:
            for chunk in _chunks((numel for _, numel in slices), bucket_numel):
                times.append(all_reduce(chunk * element_bytes, n, net))
        else:
            by_partition: dict[int, list[int]] = {}
            for partition, numel in slices:
                by_partition.setdefault(partition, []).append(numel)
            for sizes in by_partition.values():
                for chunk in _chunks(sizes, bucket_numel):
                    times.append(rooted(chunk * element_bytes, n, net))
    if n > 1:
        times.append(all_gather(padded * element_bytes, n, net))
    return cost_of([*times, _norm(n, net)])


def cost_report(
    buckets: Sequence[Bucket],
    numels: Sequence[int],
    fullest: int,
    n: int,
    bucket_numel: int,
    net: Network,
    element_bytes: int,
) -> dict[str, Any]:
    """The patterns (and stock with ``use_multi_rank_bucket_allreduce`` false) with the ratios to stock;
    ``fullest`` is the fullest rank's elements (what the stripes are cut from)."""
    per_owner = per_owner_cost(buckets, n, net, element_bytes)
    grouped = tensorshard_grouped_cost(buckets, n, net, element_bytes)
    stock = stock_zero2_cost(numels, n, bucket_numel, net, element_bytes)
    stock_reduce = stock_zero2_cost(numels, n, bucket_numel, net, element_bytes, multi_rank=False)
    ratio = lambda cost: cost.seconds / stock.seconds if stock.seconds else 1.0  # noqa: E731
    striped = tensorshard_stripes_cost(fullest, n, bucket_numel, net, element_bytes)
    return {
        "network": asdict(net),
        "element_bytes": element_bytes,
        "tensorshard_per_owner": asdict(per_owner),
        "tensorshard_grouped": asdict(grouped),
        "tensorshard_stripes": asdict(striped),
        "stock_zero2": asdict(stock),
        "stock_zero2_reduce": asdict(stock_reduce),
        "per_owner_time_ratio": ratio(per_owner),
        "grouped_time_ratio": ratio(grouped),
        "stripes_time_ratio": ratio(striped),
    }
