"""One rank of one benchmark configuration (started by ``ds-tensorshard bench`` under mpiexec).

Trains the GPT (or, ``--model lora``, the LoRA-like model) of :mod:`ds_tensorshard.commands.models` for
``--steps`` timed steps after ``--warmup`` steps and writes ``OUT/CONFIG.rankR.json``: per-step wall times
split into forward+backward, reduce (time spent after backward finishing gradient reduction; reduction
overlapped with backward counts in forward+backward), optimizer and gather, the process's CPU time per step
(every thread), every step's losses, the ATen operators and host syncs of one more step's ``step()``
(:mod:`.op_count`), plus peak RSS, optimizer-state bytes and the bytes this rank sent
through collectives (:mod:`.traffic`). The configurations are built by :mod:`.setups`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as tdist

from ds_tensorshard.bench.clock import Clock
from ds_tensorshard.bench.configs import ONE_MODEL_CONFIGS, TWO_MODEL_CONFIGS, add_run_arguments, second_model_shape
from ds_tensorshard.bench.setups import (
    Setup,
    build_ddp,
    build_deepspeed,
    build_fsdp2,
    build_model,
    count_step,
    trainable,
)
from ds_tensorshard.bench.traffic import SENT, count_mpi_collectives, count_shared_memory, count_torch_collectives


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", choices=ONE_MODEL_CONFIGS + TWO_MODEL_CONFIGS)
    parser.add_argument("out")
    add_run_arguments(parser)
    parser.add_argument("--port", type=int, default=29500)
    return parser.parse_args()


def start(port: int) -> torch.device:
    """Count the collectives (torch's before DeepSpeed binds them), join the process group; this rank's device."""
    count_torch_collectives()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    count_mpi_collectives()
    count_shared_memory()
    on_gpu = get_accelerator().device_name() == "cuda"  # DS_ACCELERATOR=cuda: one GPU per rank, NCCL
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", distributed_port=port)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return device


def build(args: argparse.Namespace, micro: int, world: int, device: torch.device) -> tuple[Setup, Clock]:
    """The configuration ``args.config`` built on this rank, and the clock of its phases."""
    torch.manual_seed(0)
    shapes = [dict(width=args.width, layers=args.layers, heads=max(1, args.width // 64))]
    if args.config in TWO_MODEL_CONFIGS:
        shapes.append(second_model_shape(args.width, args.layers))
    models = [build_model(args, shape).to(device) for shape in shapes]
    clock = Clock.of_gathers()
    if args.config in ("ddp_zero", "fsdp2", "fsdp2_reshard"):
        model = models[0].to(torch.bfloat16) if args.dtype == "bf16" else models[0]
        if args.config == "ddp_zero":
            setup = build_ddp(model, world, clock)
        else:
            setup = build_fsdp2(model, world, device, reshard=args.config == "fsdp2_reshard")
    else:
        setup = build_deepspeed(args.config, models, micro, args, clock)
    return setup, clock


def timed_step(setup: Setup, clock: Clock, tokens: torch.Tensor) -> dict[str, Any]:
    """One training step after a barrier: its wall and CPU time, its phases, bytes sent and copied, its losses."""
    from deepspeed.accelerator import get_accelerator

    clock.spent.clear()
    sent_before, host_before = sum(SENT.values()), setup.host_bytes()
    tdist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    losses = setup.train(tokens)
    get_accelerator().synchronize()
    after_backward = time.perf_counter()
    setup.step()
    get_accelerator().synchronize()
    end, cpu_end = time.perf_counter(), time.process_time()
    reduce, gather_s = clock.spent["reduce"], clock.spent["gather"]
    return {
        "step_s": end - start,
        "cpu_s": cpu_end - cpu_start,
        "fwd_bwd_s": after_backward - start - reduce,
        "reduce_s": reduce,
        "optimizer_s": end - after_backward - gather_s,
        "gather_s": gather_s,
        "sent_bytes": sum(SENT.values()) - sent_before,
        "host_bytes": setup.host_bytes() - host_before,
        "losses": losses,
    }


def main() -> None:
    args = parse_arguments()
    device = start(args.port)
    from ds_tensorshard.commands.models import synthetic_batch
    from ds_tensorshard.transports.torch_comm import close_process_group

    world, rank = tdist.get_world_size(), tdist.get_rank()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    micro = args.global_batch // world
    setup, clock = build(args, micro, world, device)
    generator = torch.Generator().manual_seed(100 + rank)
    rows, losses_by_step = [], []
    for index in range(args.warmup + args.steps):
        row = timed_step(setup, clock, synthetic_batch(micro, args.seq, args.vocab, generator).to(device))
        losses_by_step.append(row["losses"])
        if index >= args.warmup:
            rows.append(row)
    tokens = synthetic_batch(micro, args.seq, args.vocab, generator).to(device)
    result = {
        **count_step(setup, tokens),  # one more step, untimed
        "config": args.config,
        "rank": rank,
        "world_size": world,
        "steps": rows,
        "losses_by_step": losses_by_step,
        "numel": sum(getattr(p, "ds_numel", p.numel()) for m in setup.models for p in trainable(m)),  # stage 3
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "optimizer_state_bytes": setup.state_bytes(),
    }
    if args.optimizer == "muon":
        result["newton_schulz_work"], result["newton_schulz_total"] = setup.newton_schulz()
    with open(os.path.join(args.out, f"{args.config}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del setup  # DDP's reducer keeps gloo work alive until collected
    close_process_group()


if __name__ == "__main__":
    main()
