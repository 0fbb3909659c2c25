"""Counts the collectives one rank launches per training step, on real ranks; prints one ``RESULT`` line per rank.

``torch``: every torch.distributed collective call is counted (wrapped before DeepSpeed binds them);
``mpi``: every call into the transport's MPI communicator. Steps 2 and 3 are counted (the first also
agrees on the order backward produces gradients in).
"""

import argparse
import gc
import json
import os
from collections import Counter

import torch
import torch.distributed as tdist

parser = argparse.ArgumentParser()
parser.add_argument("--comm-backend", choices=["torch", "mpi"], required=True)
parser.add_argument("--bucket-layout", choices=["windows", "stripes", "flat"], default="windows")
args = parser.parse_args()

calls: Counter = Counter()
for name in (
    "reduce",
    "broadcast",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    *(name for name in ("all_gather_single", "reduce_scatter_single") if hasattr(tdist, name)),
):
    original = getattr(tdist, name)

    def counted(*a, _original=original, _name=name, **k):
        calls[_name] += 1
        return _original(*a, **k)

    setattr(tdist, name, counted)


class CountingCommunicator:
    """The transport's mpi4py communicator, every method call counted by name."""

    def __init__(self, comm) -> None:
        self._comm = comm

    def __getattr__(self, name):
        method = getattr(self._comm, name)

        def call(*a, **k):
            calls[name] += 1
            return method(*a, **k)

        return call


import deepspeed  # noqa: E402  (after the wrapping: DeepSpeed binds torch.distributed's functions)

import ds_tensorshard  # noqa: E402, F401

deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "tensorshard": {
        "enabled": True,
        "comm_backend": args.comm_backend,
        "bucket_numel": 96,
        "bucket_layout": args.bucket_layout,
        "shared_memory": False,  # the transports' own collectives counted, not the shared-memory lane's
    },
}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
if args.comm_backend == "mpi":
    optimizer.comm.mpi = CountingCommunicator(optimizer.comm.mpi)
per_step = []
for _ in range(3):
    calls.clear()
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    per_step.append(dict(calls))
buckets = optimizer.buckets
line = "RESULT " + json.dumps(
    {
        "rank": engine.global_rank,
        "buckets": len(buckets),
        "segments": sum(len(b.segments) for b in buckets),
        "one_owner": sum(len(b.segments) == 1 for b in buckets),
        "full": sum(len(b.segments) == engine.world_size for b in buckets),
        "per_step": per_step[1:],
    }
)
os.write(1, (line + "\n").encode())
del engine, optimizer, model
gc.collect()  # gloo work still referenced at interpreter exit can abort the process
tdist.barrier()
tdist.destroy_process_group()
