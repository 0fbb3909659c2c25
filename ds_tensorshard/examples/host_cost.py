"""Host-side bookkeeping at scale, measured in one process over meta tensors (no data moves).

    python -m ds_tensorshard.examples.host_cost --tensors 10000 --world-size 64 256 1024

For each world size: the time to build the plan and the buckets, and the per-step host work of
rank 0's data path (every gradient hook, packing, one reduce and one broadcast per owner in each
bucket, delivering its own pieces, writing back the gathered ones) with a transport that returns
at once. Prints one JSON line per world size.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from ds_tensorshard.datapath.broadcast import Broadcast
from ds_tensorshard.datapath.buckets import build_buckets
from ds_tensorshard.datapath.plan import plan_ownership
from ds_tensorshard.datapath.reduce import Averaging, OverlappedReducer
from ds_tensorshard.transports.protocol import Pending, Span


class InstantComm:
    """A transport whose collectives complete at once and move nothing."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size
        self.global_ranks, self.timeout_s, self.name = list(range(world_size)), float("inf"), "instant"
        self.broadcasts_by_owner = True
        self.device = torch.device("cpu")

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        return Pending(lambda: None)

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        return Pending(lambda: None)

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return Pending(lambda: None)

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return Pending(lambda: None)

    def start_reduce_scatter(self, flat: torch.Tensor, slot: int) -> Pending:
        return Pending(lambda: None)

    def start_all_gather(self, flat: torch.Tensor, slot: int) -> Pending:
        return Pending(lambda: None)

    def start_all_reduce(self, flat: torch.Tensor) -> Pending:
        return Pending(lambda: None)

    def all_reduce_sum(self, tensor: torch.Tensor, where: Callable[[], str] | None = None) -> None:
        return None

    def fail(self, message: str) -> NoReturn:
        raise RuntimeError(message)


def shapes(count: int, seed: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` tensors of transformer-like shapes: matrices, vectors and a few embeddings."""
    rnd = random.Random(seed)
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(count):
        kind = rnd.random()
        shape = (
            (rnd.choice([1024, 2048, 4096]), rnd.choice([1024, 4096]))
            if kind < 0.5
            else (rnd.choice([1024, 4096]),)
            if kind < 0.98
            else (rnd.choice([32000, 50257]), 1024)
        )
        out.append((f"t{i:05d}", shape))
    return out


def measure(tensors: list[tuple[str, tuple[int, ...]]], world_size: int, bucket_numel: int, steps: int) -> dict:
    params = [torch.nn.Parameter(torch.empty(shape, device="meta")) for _, shape in tensors]
    names = {id(p): name for p, (name, _) in zip(params, tensors)}
    started = time.perf_counter()
    plan = plan_ownership(tensors, world_size, param_names=names)
    buckets = build_buckets(list(reversed(params)), plan.blocks_of, bucket_numel)
    build_s = time.perf_counter() - started
    comm = InstantComm(world_size)
    reducer = OverlappedReducer(
        buckets, comm, Averaging(), lambda bucket, segment: None, params, lambda p: names[id(p)], lambda order: buckets
    )
    reducer.observed = None  # the order is already backward's
    times = []
    for _ in range(steps):
        for param in params:
            param.grad = torch.empty_like(param)
        started = time.perf_counter()
        for param in reversed(params):
            reducer.gradient_ready(param)
        reducer.finish()
        Broadcast(buckets, comm).finish()
        times.append(time.perf_counter() - started)
    return {
        "world_size": world_size,
        "tensors": len(tensors),
        "split": len(plan.split),
        "buckets": len(buckets),
        "plan_and_buckets_s": round(build_s, 4),
        "host_step_s": round(min(times), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--world-size", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--bucket-numel", type=int, default=4_000_000)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    tensors = shapes(args.tensors)
    for world_size in args.world_size:
        print("HOST " + json.dumps(measure(tensors, world_size, args.bucket_numel, args.steps)), flush=True)


if __name__ == "__main__":
    main()
