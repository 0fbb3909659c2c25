"""One rank of a failure-injection run: TinyGPT, ds_tensorshard stage 2, tensorshard.timeout_s short.

python hang_worker.py MODE BACKEND TIMEOUT_S
MODE: ``stop`` (rank 1 SIGSTOPs itself in the middle of step 2's backward), ``skip`` (rank 1 skips
step 2, as a rank whose data ran out early: it ends one step before the others), ``offset`` (rank 1's
step counter is one ahead, as after resuming another checkpoint than the others), ``kill`` (rank 1
SIGKILLs itself in the middle of step 2's backward), ``none``; a peer lost at start-up, at the first collective or
at the end: ``stop-init``/``kill-init`` (rank 1 stops or dies before ``deepspeed.initialize``),
``stop-first``/``kill-first`` (in step 0's backward), ``stop-exit``/``kill-exit`` (after its last step, before
the script ends).
BACKEND: tensorshard.comm_backend (torch or mpi). Prints ``EVENT <name> <unix time>`` lines, and appends
them to the file ``HANG_EVENTS`` names (a launcher may lose a killed rank's last output).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, batch, ds_config, param_groups

STEPS, FAULTY_STEP = 6, 2


def event(name: str) -> None:
    line = f"EVENT {name} {time.time():.3f}"
    print(line, flush=True)
    if os.environ.get("HANG_EVENTS"):
        with open(os.environ["HANG_EVENTS"], "a") as f:
            f.write(line + "\n")


def lose_this_rank(how: str) -> None:
    event(how)
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    mode, backend, timeout_s = argv[0], argv[1], float(argv[2])
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = ds_config("fp32", "tsmpi" if backend == "mpi" else "ts", 2, world)
    config.update(gradient_accumulation_steps=1, train_batch_size=2 * world)
    config["tensorshard"]["timeout_s"] = timeout_s
    lost_peer, _, point = mode.partition("-")
    if rank == 1 and point == "init":
        lose_this_rank(lost_peer)
    torch.manual_seed(1234)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    faulty = rank == 1 and (mode in ("stop", "kill") or point == "first")
    faulty_step = 0 if point == "first" else FAULTY_STEP
    if mode == "offset" and rank == 1:
        engine.global_steps += 1

    def mid_backward(grad):
        if faulty and engine.global_steps == faulty_step:
            lose_this_rank(lost_peer)
        return grad

    model.blocks[0].fc.weight.register_hook(mid_backward)
    for step in range(STEPS):
        if mode == "skip" and rank == 1 and step == FAULTY_STEP:
            event("skip")
            continue
        engine.backward(engine(batch(rank, step)))
        engine.step()
        event(f"step{step}")
    event("done")
    if rank == 1 and point == "exit":
        lose_this_rank(lost_peer)
    close_process_group()


if __name__ == "__main__":
    main()
