"""An unmodified DeepSpeed training script: it never imports ds_tensorshard.

Run through ``python -m ds_tensorshard`` the config's tensorshard block takes effect; prints one
``RESULT`` line per rank.
"""

import argparse
import gc
import glob
import hashlib
import json
import os

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--one-tensor", action="store_true", help="a model of a single tensor: other ranks own nothing")
parser.add_argument("--comm-backend", default="torch")
parser.add_argument("--no-block", action="store_true", help="a config without the tensorshard block (DS_TENSORSHARD=1)")
parser.add_argument("--port", type=int, default=29500, help="rendezvous port when ranks are discovered through MPI")
args = parser.parse_args()

config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "tensorshard": {"enabled": True, "comm_backend": args.comm_backend},
}
if args.one_tensor:  # whole tensors, so that the other ranks own nothing (flat parameters split at slot boundaries)
    config["tensorshard"]["bucket_layout"] = "windows"
if args.no_block:
    del config["tensorshard"]
deepspeed.init_distributed(dist_backend="gloo", distributed_port=args.port)
torch.manual_seed(0)
if args.one_tensor:
    model = torch.nn.Linear(8, 1, bias=False)
else:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
initial = [p.detach().clone() for p in model.parameters()]
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(args.steps):
    x = torch.randn(2, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
comm = getattr(optimizer, "comm", None)
# one short write per line, so the launcher's merged output never interleaves two ranks' lines
line = "RESULT " + json.dumps(
    {
        "rank": engine.global_rank,
        "local_rank": args.local_rank,
        "master_port": os.environ.get("MASTER_PORT"),
        "transport": type(getattr(comm, "inner", comm)).__name__,  # the lane's own transport where it is taken
        "shared_memory": hasattr(comm, "inner"),
        "optimizer": type(optimizer).__name__,
        "params_digest": hashlib.sha1(
            b"".join(p.detach().numpy().tobytes() for p in engine.module.parameters())
        ).hexdigest(),
        "moved": any(not torch.equal(p, q) for p, q in zip(engine.module.parameters(), initial)),
        "numel_per_rank": list(optimizer.plan.numel_per_rank) if hasattr(optimizer, "plan") else None,
        # DeepSpeed's CPU all-reduce segments of this launch (see tests/helpers/ranks.py launch_segments)
        "shm_segments": len(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_PORT')}_*")),
    }
)
os.write(1, (line + "\n").encode())
del engine, optimizer, model
gc.collect()  # gloo work still referenced at interpreter exit can abort the process
torch.distributed.barrier()
torch.distributed.destroy_process_group()
