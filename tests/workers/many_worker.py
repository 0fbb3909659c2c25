"""One rank of a multi-model run: three TinyGPTs of different sizes, dtypes and stages trained in one loop.

python many_worker.py OUT MODE   with MODE = stock (each its own stock ZeRO engine),
step_many (initialize_many + step_many), step_many_mpi (the same on the mpi backend, under mpiexec),
step_many_stripes (with bucket_layout "stripes"), step_many_flat (each model initialized alone with flat parameters,
then step_many) or one_by_one (initialize_many + engine.step each).
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import ds_tensorshard
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.compare import TOLERANCE
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import GAS, SEQ, STEPS, VOCAB, batch, ds_config, param_groups

# (dtype, ZeRO stage, shape): stage 1 reduces only at the accumulation boundary, stage 2 every micro-step
MODELS = [
    ("fp32", 2, dict(width=32, layers=2)),
    ("bf16", 2, dict(width=48, layers=1)),
    ("fp32", 1, dict(width=16, layers=1)),
]


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    flavours = {"stock": "stock", "step_many_mpi": "tsmpi", "step_many_stripes": "ts-stripes"}
    flavours["step_many_flat"] = "ts-flat"
    items, flavour = [], flavours.get(mode, "ts")
    for seed, (dtype, stage, shape) in enumerate(MODELS):
        torch.manual_seed(100 + seed)
        model = TinyGPT(vocab=VOCAB, seq=SEQ, **shape)
        items.append(
            dict(model=model, model_parameters=param_groups(model), config=ds_config(dtype, flavour, stage, world))
        )
    if mode in ("stock", "step_many_flat"):  # flat parameters: each model initialized alone (no joint plan)
        engines = [deepspeed.initialize(**item)[0] for item in items]
    else:
        engines = [result[0] for result in ds_tensorshard.initialize_many(items)]
    losses = [[] for _ in engines]
    broadcasts_running = []  # step_many: was the first model's all-gather in flight while the second updated?
    if mode.startswith("step_many"):
        first, second = engines[0].optimizer, engines[1].optimizer
        update = second.shard.step

        def observed_update() -> None:
            broadcasts_running.append(first.pending_broadcast is not None and bool(first.pending_broadcast.in_flight))
            update()

        second.shard.step = observed_update
    left_in_flight = []  # per backward of a sharded engine: reductions still running when it returned
    for micro in range(STEPS * GAS):
        for index, engine in enumerate(engines):
            loss = engine(batch(rank + 17 * index, micro))
            engine.backward(loss)
            if mode != "stock" and (MODELS[index][1] == 2 or engine.is_gradient_accumulation_boundary()):
                left_in_flight.append(len(engine.optimizer.reducer.in_flight))
            losses[index].append(loss.item())
        if mode.startswith("step_many"):
            ds_tensorshard.step_many(engines)
        else:
            for engine in engines:
                engine.step()
    result = {
        "losses": losses,
        "params": [{n: p.detach().float().clone() for n, p in e.module.named_parameters()} for e in engines],
    }
    if mode != "stock":
        plans = [e.optimizer.plan for e in engines]
        result["same_plan"] = all(plan is plans[0] for plan in plans)
        result["layouts"] = [e.optimizer.layout.layout for e in engines]
        result["left_in_flight"] = left_in_flight
        result["broadcasts_running"] = broadcasts_running
        result["numel_per_rank"] = list(plans[0].numel_per_rank)
        result["owners"] = [
            [b.rank for p in e.module.parameters() if p.requires_grad for b in e.optimizer.plan.blocks_of(p)]
            for e in engines
        ]
        result["owned_numel"] = [sum(m.numel() for g in e.optimizer.param_groups for m in g["params"]) for e in engines]
    torch.save(result, os.path.join(out, f"{mode}.rank{rank}.pt"))
    close_process_group()


def assert_each_model_matches_stock(joint: dict, stock: dict) -> None:
    """Each model of a joint run trained as it did alone under stock ZeRO."""
    for index, (dtype, _, _) in enumerate(MODELS):
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(
            torch.tensor(joint["losses"][index]), torch.tensor(stock["losses"][index]), rtol=0, atol=tol["loss"]
        )
        for name, value in stock["params"][index].items():
            torch.testing.assert_close(
                joint["params"][index][name],
                value,
                rtol=tol["rtol"],
                atol=tol["atol"],
                msg=lambda m, index=index, name=name: f"model {index} {name}: {m}",
            )


def assert_overlapped(joint: dict) -> None:
    """Reductions were left running after every reducing backward, and the second model was updated
    while the first one's all-gathers were in flight; the exact results show all of them completed."""
    assert all(count > 0 for count in joint["left_in_flight"])
    assert joint["broadcasts_running"] and all(joint["broadcasts_running"])


if __name__ == "__main__":
    main()
