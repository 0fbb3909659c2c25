"""Two GPTs of different sizes trained together on one joint ds_tensorshard plan.

    deepspeed --num_gpus 2 --module ds_tensorshard.examples.train_two_models --steps 20

Prints the joint plan next to what planning each model on its own would put on every rank, then
times ``step_many`` (one joint step) against stepping the engines one after the other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import deepspeed
import torch
from deepspeed import comm as dist

import ds_tensorshard
from ds_tensorshard.commands.models import build, synthetic_batch
from ds_tensorshard.datapath.plan import plan_ownership
from ds_tensorshard.transports.torch_comm import close_process_group

SHAPES = {
    "large": dict(width=256, layers=6, vocab=512, seq=64, heads=4),
    "small": dict(width=96, layers=3, vocab=512, seq=64, heads=4),
}


def config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True},
        "steps_per_print": 10**9,
    }


def per_model_loads(models: dict, world: int) -> list[int]:
    """Elements per rank if each model were planned on its own (their loads add up on the same ranks)."""
    loads = [0] * world
    for model in models.values():
        plan = plan_ownership([(n, p.shape) for n, p in model.named_parameters()], world)
        loads = [a + b for a, b in zip(loads, plan.numel_per_rank)]
    return loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per stepping mode")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    models = {name: build("demo", "cpu", **shape) for name, shape in SHAPES.items()}
    results = ds_tensorshard.initialize_many(
        [dict(model=m, model_parameters=m.parameters(), config=config()) for m in models.values()]
    )
    engines = dict(zip(models, (r[0] for r in results)))
    joint = engines["large"].optimizer.plan
    if rank == 0:
        separate = per_model_loads(models, world)
        print(
            f"joint plan, elements per rank:        {list(joint.numel_per_rank)} "
            f"(fullest / ideal {joint.imbalance:.4f})"
        )
        print(
            f"per-model plans, summed per rank:     {separate} "
            f"(fullest / ideal {max(separate) / (sum(separate) / world):.4f})"
        )
    generator = torch.Generator().manual_seed(rank)
    timings: dict[str, list[float]] = {"step_many": [], "one by one": []}
    losses: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(2 * args.steps + 2):
        mode = "step_many" if step % 2 == 0 else "one by one"
        for name, engine in engines.items():
            shape = SHAPES[name]
            loss = engine(synthetic_batch(2, shape["seq"], shape["vocab"], generator))
            engine.backward(loss)
            losses[name].append(loss.item())
        dist.barrier()
        start = time.perf_counter()
        if mode == "step_many":
            ds_tensorshard.step_many(list(engines.values()))
        else:
            for engine in engines.values():
                engine.step()
        elapsed = time.perf_counter() - start
        if step >= 2:
            timings[mode].append(elapsed)
    if rank == 0:
        for mode, values in timings.items():
            print(f"optimizer step of both models, {mode:>10}: median {statistics.median(values) * 1000:.1f} ms")
        for name, values in losses.items():
            print(
                f"{name} model ({sum(p.numel() for p in models[name].parameters()):,} parameters): "
                f"loss {values[0]:.4f} -> {values[-1]:.4f}"
            )
    close_process_group()


if __name__ == "__main__":
    main()
