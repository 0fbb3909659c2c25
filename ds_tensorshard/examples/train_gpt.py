"""Train a small GPT with ds_tensorshard, then compare its optimizer-state bytes with stock ZeRO-2.

Run with the deepspeed launcher (see launch/demo.sh)::

    deepspeed --num_gpus 2 --module ds_tensorshard.examples.train_gpt --deepspeed_config configs/tensorshard_fp32.json
"""

from __future__ import annotations

import argparse
import copy
import json

import deepspeed
import torch
from deepspeed import comm as dist

import ds_tensorshard
from ds_tensorshard.commands import progress
from ds_tensorshard.commands.models import PRESETS, build, synthetic_batch
from ds_tensorshard.transports.torch_comm import close_process_group


def optimizer_state_bytes(optimizer, model) -> int:
    """Bytes of optimizer state this rank holds beyond the model: fp32 masters (unless they are the model's
    own fp32 tensors, as ds_tensorshard arranges) plus Adam moments."""
    if isinstance(optimizer, ds_tensorshard.TensorShardOptimizer):
        masters = [m for group in optimizer.param_groups for m in group["params"]]
    else:  # stock ZeRO-1/2: one flat fp32 partition per param group
        masters = list(optimizer.single_partition_of_fp32_groups)
    model_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    masters = [m for m in masters if m.untyped_storage().data_ptr() not in model_storage]
    moments = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    return sum(t.numel() * t.element_size() for t in masters + moments)


def train(config: dict, steps: int, preset: str, show_progress: bool) -> tuple[list[float], int]:
    """Train ``steps`` optimizer steps; a bar on rank 0 when ``show_progress`` (stdout is a terminal)."""
    torch.manual_seed(0)
    model = build(preset)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    generator = torch.Generator().manual_seed(1000 + rank)
    losses = []
    bar = progress.bar(steps, "train", "step", show=show_progress)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        tokens = synthetic_batch(micro, PRESETS[preset]["seq"], PRESETS[preset]["vocab"], generator).to(engine.device)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:  # a step just ended
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    return losses, optimizer_state_bytes(optimizer, engine.module)


def gathered(value: int) -> list[int]:
    values = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value]))
    return [int(v.item()) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deepspeed_config", required=True, help="ds_config JSON with a tensorshard block")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    args = parser.parse_args()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    deepspeed.init_distributed()
    rank = dist.get_rank()

    losses, ts_bytes = train(config, args.steps, args.preset, show_progress=rank == 0 and progress.interactive())
    stock = copy.deepcopy(config)
    stock.pop("tensorshard", None)
    stock["zero_optimization"] = {**stock.get("zero_optimization", {}), "stage": 2}
    _, stock_bytes = train(stock, 1, args.preset, show_progress=False)

    ts_all, stock_all = gathered(ts_bytes), gathered(stock_bytes)
    if rank == 0:
        print(f"\nloss: start {losses[0]:.4f} -> end {losses[-1]:.4f} over {len(losses)} steps")
        print("optimizer state per rank beyond the model (fp32 masters + Adam moments):")
        for r, (ts, st) in enumerate(zip(ts_all, stock_all)):
            print(f"  rank {r}: ds_tensorshard {ts / 2**20:8.3f} MiB   stock ZeRO-2 {st / 2**20:8.3f} MiB")
        print(
            f"  total : ds_tensorshard {sum(ts_all) / 2**20:8.3f} MiB   stock ZeRO-2 {sum(stock_all) / 2**20:8.3f} MiB"
        )
    close_process_group()


if __name__ == "__main__":
    main()
