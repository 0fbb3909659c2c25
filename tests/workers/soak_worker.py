"""One rank of a soak run: TinyGPT for many steps with GAS, a checkpoint every SAVE_EVERY steps.

python soak_worker.py OUT MODE STEPS [--save DIR] [--load DIR --tag TAG]   (MODE stock, ts or tsmpi; stage 2)
Rank 0 writes OUT: the mean loss of every step run here and, per rank, the peak RSS after each
RSS_EVERY steps (so growth over the run shows).
"""

from __future__ import annotations

import argparse
import os
import resource

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, batch, ds_config, param_groups

GAS, SAVE_EVERY, RSS_EVERY = 2, 500, 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode")
    parser.add_argument("steps", type=int)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--tag")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    config = ds_config("fp32", args.mode, 2, world)
    # no clipping: the norm's fp32 partial sums cover other elements on each rank than stock's, so their
    # sum can differ in the last bit; a clipped step then differs by that much, and over thousands of
    # steps at lr 1e-2 the runs drift apart (1.4e-4 in the loss by step 115 with clipping, measured)
    config.update(gradient_accumulation_steps=GAS, train_batch_size=2 * GAS * world, gradient_clipping=0.0)
    torch.manual_seed(1234)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    if args.load:
        assert engine.load_checkpoint(args.load, tag=args.tag)[0] is not None
    losses, peaks = {}, {}
    while engine.global_steps < args.steps:
        step = engine.global_steps
        total = 0.0
        for micro in range(GAS):
            loss = engine(batch(rank, step * GAS + micro))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses[step] = total / GAS
        if engine.global_steps % RSS_EVERY == 0:
            peaks[engine.global_steps] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if args.save and engine.global_steps % SAVE_EVERY == 0:
            engine.save_checkpoint(args.save, tag=f"step{engine.global_steps}")
    every = [None] * world
    torch.distributed.all_gather_object(every, peaks)
    if rank == 0:
        torch.save({"losses": losses, "peak_rss": every}, args.out)
    close_process_group()


if __name__ == "__main__":
    main()
