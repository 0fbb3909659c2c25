"""Time the data path's collectives on N fp32 elements with each comm backend (run under mpiexec).

    mpiexec -n 2 python -m ds_tensorshard.examples.comm_bench --numel 25000000 100000000

N elements split into one equal segment per rank are reduced, each onto its owner, then broadcast
back from every owner, as the data path moves a window (pattern ``owners``); and as a stripe of N elements
moves, each of its collectives on its own: ``reduce_scatter``, ``all_gather``, ``all_reduce`` (what
``datapath/defaults.py`` routes by). Rank 0 prints one JSON line per (size, backend, pattern) with the median of
``--repeats`` timings.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable

import deepspeed
import torch
from deepspeed import comm as dist

from ds_tensorshard.transports.mpi_comm import MpiComm
from ds_tensorshard.transports.protocol import Transport
from ds_tensorshard.transports.torch_comm import TorchComm, close_process_group


def owners(comm: Transport, flat: torch.Tensor) -> None:
    """A window's way: one reduce onto each owner of an equal segment, then one broadcast from each."""
    n = comm.world_size
    counts = [flat.numel() // n + (1 if r < flat.numel() % n else 0) for r in range(n)]
    segments = flat.split(counts)
    for pending in [comm.start_reduce(seg, owner) for owner, seg in enumerate(segments)]:
        pending.wait()
    for pending in [comm.start_broadcast(seg, owner) for owner, seg in enumerate(segments)]:
        pending.wait()


PATTERNS: dict[str, Callable[[Transport, torch.Tensor], None]] = {
    "owners": owners,
    "reduce_scatter": lambda comm, flat: comm.start_reduce_scatter(flat, flat.numel() // comm.world_size).wait(),
    "all_gather": lambda comm, flat: comm.start_all_gather(flat, flat.numel() // comm.world_size).wait(),
    "all_reduce": lambda comm, flat: comm.start_all_reduce(flat).wait(),
}


def time_once(comm: Transport, flat: torch.Tensor, pattern: str) -> float:
    dist.barrier()
    start = time.perf_counter()
    PATTERNS[pattern](comm, flat)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, nargs="+", default=[25_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=["owners"])
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each collective")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=args.port)
    group = dist.new_group(list(range(dist.get_world_size())))
    transports: dict[str, Transport] = {
        "torch": TorchComm(group, args.timeout_s, torch.device("cpu")),
        "mpi": MpiComm(group, args.timeout_s, torch.device("cpu")),
    }
    n = dist.get_world_size()
    for numel, (name, comm), pattern in itertools.product(args.numel, transports.items(), args.patterns):
        flat = torch.ones(numel - numel % n if pattern != "owners" else numel)  # a stripe: n equal slots
        times = [time_once(comm, flat, pattern) for _ in range(args.repeats)]
        if dist.get_rank() == 0:
            row = {"backend": name, "pattern": pattern, "ranks": n, "numel": flat.numel()}
            print("COMM " + json.dumps(row | {"median_s": round(statistics.median(times), 4)}), flush=True)
        del flat
    del transports
    close_process_group()


if __name__ == "__main__":
    main()
