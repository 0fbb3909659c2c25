"""One rank of an elastic run (torchrun): TinyGPT at a fixed global batch, a checkpoint saved after every step,
and on start the latest checkpoint loaded, whatever world size saved it.

python elastic_worker.py SAVE_DIR LOG MODE STEPS [--load-tag TAG] [--no-save] [--step-sleep S]
    [--hold-save-at K --hold-host HOST] [--pids DIR]

MODE ``ts`` (ds_tensorshard, ZeRO-2 block) or ``stock`` (stock ZeRO-2). The config gives only
``train_batch_size`` (``GLOBAL_BATCH``) and the micro batch (1): DeepSpeed derives gradient_accumulation_steps
at the world size it starts at, and the same sequences make up step s at every world size. Rank 0 appends one
JSON line to LOG when it starts (``event`` "start": world, gas, restart count, the tag loaded) and one after each
step (``event`` "step": its mean loss over the global batch). ``--hold-save-at K --hold-host HOST``: at world
size 4, in the save after step K, the ranks on HOST write half of their first file and then wait, never
finishing it, until they are killed (a host lost in the middle of a save); each writes a file ``HOLDING-<rank>``
beside the checkpoints first. ``--pids DIR``: each rank writes DIR/<hostname>/<pid>, for the test to kill that
host's processes by id. A save that fails prints ``SAVE FAILED <error>`` and exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.errors import CheckpointError
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.checkpoint_worker import sample
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config, param_groups

GLOBAL_BATCH = 8


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("save_dir")
    parser.add_argument("log")
    parser.add_argument("mode", choices=("ts", "stock"))
    parser.add_argument("steps", type=int)
    parser.add_argument("--load-tag", help="load this tag instead of the latest (a resume by hand)")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each step")
    parser.add_argument("--hold-save-at", type=int)
    parser.add_argument("--hold-host")
    parser.add_argument("--pids")
    return parser.parse_args(argv)


def log(path: str, **record: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def hold_inside_torch_save(save_dir: str, rank: int) -> None:
    """From now on torch.save writes half a file, says so in SAVE_DIR/HOLDING-<rank>, and waits to be killed."""
    real_save = torch.save

    def save_half_then_wait(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        os.truncate(f, os.path.getsize(f) // 2)
        with open(os.path.join(save_dir, f"HOLDING-{rank}"), "w") as marker:
            marker.write(str(os.getpid()))
        while True:
            time.sleep(1)

    torch.save = save_half_then_wait


def main() -> None:
    args = parse(sys.argv[1:])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    host = socket.gethostname()
    if args.pids:
        os.makedirs(os.path.join(args.pids, host), exist_ok=True)
        open(os.path.join(args.pids, host, str(os.getpid())), "w").close()
    config = ds_config("fp32", args.mode, 2, world)
    del config["gradient_accumulation_steps"]  # DeepSpeed derives it from the batch sizes at this world size
    config.update(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=1)
    if args.mode == "ts":
        config["tensorshard"]["timeout_s"] = 60
    torch.manual_seed(1234)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    gas = engine.gradient_accumulation_steps()
    loaded = None
    if args.load_tag or os.path.exists(os.path.join(args.save_dir, "latest")):
        path, _ = engine.load_checkpoint(args.save_dir, tag=args.load_tag)
        assert path is not None, f"nothing loaded from {args.save_dir}"
        loaded = os.path.basename(os.path.dirname(path))  # SAVE_DIR/TAG/mp_rank_00_model_states.pt
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(
        f"ELASTIC START host={host} rank={rank} world={world} gas={gas} restart={restart} loaded={loaded} "
        f"step={engine.global_steps}",
        flush=True,
    )
    if rank == 0:
        log(
            args.log,
            event="start",
            host=host,
            world=world,
            gas=gas,
            restart=restart,
            loaded=loaded,
            step=engine.global_steps,
        )
    while engine.global_steps < args.steps:
        step = engine.global_steps
        total = torch.zeros(())
        for micro in range(gas):
            tokens = sample(step, micro * world + rank).unsqueeze(0)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        if rank == 0:
            log(args.log, event="step", world=world, gas=gas, step=step, loss=total.item() / (gas * world))
        if not args.no_save:
            if engine.global_steps == args.hold_save_at and host == args.hold_host and world == 4:
                hold_inside_torch_save(args.save_dir, rank)
            try:
                engine.save_checkpoint(args.save_dir, tag=f"step{engine.global_steps}")
            except CheckpointError as err:
                print(f"SAVE FAILED {err}", flush=True)
                sys.exit(3)
        time.sleep(args.step_sleep)
    close_process_group()


if __name__ == "__main__":
    main()
