"""One rank of a tensor-parallel run: TPGPT on a tensor-parallel x data-parallel grid, stock or ds_tensorshard.

python tp_worker.py OUT TP CASE [CASE...] [--save DIR --save-at K] [--load DIR]
CASE = DTYPE:MODE:STAGE (MODE stock, ts, tsmpi). The global batch is 8 sequences per step whatever the
data-parallel size (the same 8 make up step s), so runs at different data-parallel sizes agree.
Writes OUT/CASE.rankR.pt: losses per step, grad norms, final parameters (this rank's shards).
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.tp_model import TPGPT, ToyMpu
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 6


def sample(step: int, index: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(10_000 * step + index))


def run_case(case: str, mpu: ToyMpu, args: argparse.Namespace) -> None:
    dtype, mode, stage = case.split(":")
    gas = GLOBAL_BATCH // (MICRO * mpu.dp_size)
    config = ds_config(dtype, mode, int(stage), mpu.dp_size)
    config.update(gradient_accumulation_steps=gas, train_batch_size=GLOBAL_BATCH)
    torch.manual_seed(4321 if args.load else 1234)
    model = TPGPT(mpu, vocab=VOCAB, seq=SEQ)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        mpu=mpu,
        config=config,
        model_parameters=[{"params": decay}, {"params": other, "weight_decay": 0.0}],
    )
    if args.load:
        path, _ = engine.load_checkpoint(args.load)
        assert path is not None, f"nothing loaded from {args.load}"
    losses, norms = {}, {}
    while engine.global_steps < STEPS:
        step = engine.global_steps
        total = torch.zeros(())
        for micro in range(gas):
            first = (micro * mpu.dp_size + mpu.dp_rank) * MICRO
            loss = engine(torch.stack([sample(step, first + i) for i in range(MICRO)]))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total, group=mpu.dp_group)
        losses[step] = total.item() / (gas * mpu.dp_size)
        norms[step] = float(engine.get_global_grad_norm() or 0.0)
        if args.save and engine.global_steps == args.save_at:
            engine.save_checkpoint(args.save, tag=f"step{engine.global_steps}")
    torch.save(
        {
            "losses": losses,
            "norms": norms,
            "optimizer_class": type(optimizer).__name__,
            "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        },
        os.path.join(args.out, f"{case.replace(':', '_')}.rank{torch.distributed.get_rank()}.pt"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tp", type=int)
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--save")
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--load")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    mpu = ToyMpu(args.tp)
    for case in args.cases:
        run_case(case, mpu, args)
    close_process_group()


if __name__ == "__main__":
    main()
