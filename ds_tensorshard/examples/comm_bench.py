"""Time the data path's collectives on N fp32 elements with each comm backend (run under mpiexec).

    mpiexec -n 2 python -m ds_tensorshard.examples.comm_bench --numel 25000000 100000000

N elements split into one equal segment per rank are reduced, each onto its owner, then broadcast
back from every owner, as the data path moves a bucket; rank 0 prints one JSON line per (backend,
size) with the median of ``--repeats`` timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import deepspeed
import torch
from deepspeed import comm as dist

from ds_tensorshard.transports.mpi_comm import MpiComm
from ds_tensorshard.transports.protocol import Transport
from ds_tensorshard.transports.torch_comm import TorchComm, close_process_group


def time_once(comm: Transport, flat: torch.Tensor, counts: list[int]) -> float:
    dist.barrier()
    start = time.perf_counter()
    offsets = [sum(counts[:r]) for r in range(len(counts))]
    segments = [flat[o : o + c] for o, c in zip(offsets, counts)]
    for pending in [comm.start_reduce(seg, owner) for owner, seg in enumerate(segments)]:
        pending.wait()
    for pending in [comm.start_broadcast(seg, owner) for owner, seg in enumerate(segments)]:
        pending.wait()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, nargs="+", default=[25_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=5)
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
    for numel in args.numel:
        counts = [numel // n + (1 if r < numel % n else 0) for r in range(n)]
        for name, comm in transports.items():
            flat = torch.ones(numel)
            times = [time_once(comm, flat, counts) for _ in range(args.repeats)]
            if dist.get_rank() == 0:
                print(
                    "COMM "
                    + json.dumps(
                        {"backend": name, "ranks": n, "numel": numel, "median_s": round(statistics.median(times), 4)}
                    ),
                    flush=True,
                )
            del flat
    del transports
    close_process_group()


if __name__ == "__main__":
    main()
