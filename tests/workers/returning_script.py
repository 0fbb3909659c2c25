"""A user's DeepSpeed script that ends by returning: no destroy_process_group, no MPI finalize, no call into
ds_tensorshard (run it through ``python -m ds_tensorshard``). TinyGPT, 6 steps, the loss averaged over the ranks
with torch.distributed after each step, as training scripts log it.

python returning_script.py MODE [OUT]
MODE ``tsmpi`` (the mpi transport), ``ts`` (torch transport) or ``stock`` (stock ZeRO-2). Each rank prints
``RETURNING rank=R losses=[...]`` as its last line, and from an ``atexit`` handler registered before
``deepspeed.initialize`` (Python runs such handlers after those registered later, the plugin's among them)
``AT EXIT rank=R process_group=B mpi_finalized=B``: what the plugin's end left for the interpreter's finalization.
"""

import atexit
import os
import sys

import deepspeed
import torch

from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, batch, ds_config, param_groups

mode = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()


def at_exit() -> None:
    from mpi4py import MPI

    print(
        f"AT EXIT rank={rank} process_group={torch.distributed.is_initialized()} mpi_finalized={MPI.Is_finalized()}",
        flush=True,
    )


atexit.register(at_exit)
config = ds_config("fp32", mode, 2, world)
config.update(gradient_accumulation_steps=1, train_batch_size=2 * world)
torch.manual_seed(1234)
model = TinyGPT(vocab=VOCAB, seq=SEQ)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
losses = []
for step in range(6):
    loss = engine(batch(rank, step))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    losses.append(round(mean.item() / world, 6))
print(f"RETURNING rank={rank} losses={losses}", flush=True)
