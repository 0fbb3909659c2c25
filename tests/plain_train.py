"""An unmodified DeepSpeed training script: it never imports ds_tensorshard.

Run through ``python -m ds_tensorshard`` the config's tensorshard block takes effect; prints one
``RESULT`` line per rank.
"""
import argparse
import json

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()

config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}, "tensorshard": {"enabled": True}}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(args.steps):
    x = torch.randn(2, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
print("RESULT " + json.dumps({"rank": engine.global_rank, "local_rank": args.local_rank,
                              "optimizer": type(optimizer).__name__,
                              "numel_per_rank": list(optimizer.plan.numel_per_rank) if hasattr(optimizer, "plan")
                              else None}), flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
