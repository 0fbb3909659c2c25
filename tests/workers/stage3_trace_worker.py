"""One rank of a stage-3 trace run: the gathers and releases DeepSpeed's coordinator makes, stock ZeRO-3 against
ds_tensorshard's owned parameters, on the same model.

Usage (per rank, RANK/WORLD_SIZE/MASTER_* set): python stage3_trace_worker.py OUT CASE [CASE...]
CASE = MODE:CHECKPOINTING:PREFETCH, MODE ``stock`` or ``ts``, CHECKPOINTING ``none``, ``deepspeed`` or
``non_reentrant``, PREFETCH ``off`` (``stage3_prefetch_bucket_size`` 0: each module's parameters gathered at its
use) or ``half`` (half a block's parameters fetched ahead). TinyGPT (tied embedding and head, a frozen and an unused
parameter) trains 3 steps of GAS 2 with every tensor partitioned (``stage3_param_persistence_threshold`` 0) and
``stage3_max_reuse_distance`` 0 (a tensor used again later, the tied one, is released and gathered again).
Writes OUT/CASE.rankR.pt: per micro-step the coordinator's events in order, ``("gather", forward, names)`` for
each collective it starts (a module's fetch, or a prefetch of later modules) and ``("release", name)``; the
largest number of elements gathered at once; the losses.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.tiny_gpt import TinyGPT

GATHER, RELEASE = (
    "_PartitionedParameterCoordinator__all_gather_params_",
    "_PartitionedParameterCoordinator__release_param",
)
STEPS, GAS = 3, 2


class Recorder:
    """Wraps the coordinator's gather and release to record them, by parameter name."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.events: list = []
        self.live = self.peak = 0
        gather, release = getattr(Coordinator, GATHER), getattr(Coordinator, RELEASE)

        def recorded_gather(coordinator, params, forward, quantize=False):
            wanted = [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]
            if wanted:
                self.events.append(("gather", forward, sorted(self.names[id(p)] for p in wanted)))
                self.live += sum(p.ds_numel for p in wanted)
                self.peak = max(self.peak, self.live)
            return gather(coordinator, params, forward, quantize)

        def recorded_release(coordinator, param, free_data=True):
            if param.ds_status.name == "AVAILABLE" and not param.ds_active_sub_modules:
                self.events.append(("release", self.names[id(param)]))
                self.live -= param.ds_numel
            return release(coordinator, param, free_data)

        setattr(Coordinator, GATHER, recorded_gather)
        setattr(Coordinator, RELEASE, recorded_release)


def config(mode: str, world: int, prefetch: int) -> dict:
    zero = {
        "stage": 3,
        "reduce_bucket_size": 3000,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": prefetch,
        "stage3_max_reuse_distance": 0,
    }
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": 2 * GAS * world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
        **({"tensorshard": {"enabled": True}} if mode == "ts" else {}),
    }


def run(case: str, recorder: Recorder, world: int) -> dict:
    mode, how, prefetch = case.split(":")
    torch.manual_seed(0)
    model = TinyGPT(checkpointing=None if how == "none" else how)
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    recorder.names = {id(p): n for n, p in model.named_parameters()}
    recorder.live = recorder.peak = 0
    params = [p for p in model.parameters() if p.requires_grad]
    bucket = block_numel // 2 if prefetch == "half" else 0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config(mode, world, bucket))
    data = torch.Generator().manual_seed(1 + engine.global_rank)
    micro_steps, losses = [], []
    for _ in range(STEPS * GAS):
        recorder.events = []
        loss = engine(torch.randint(0, 64, (2, 16), generator=data))
        engine.backward(loss)
        engine.step()
        micro_steps.append(recorder.events)
        losses.append(loss.item())
    total = sum(p.ds_numel for p in model.parameters())
    return {"micro_steps": micro_steps, "peak": recorder.peak, "total": total, "losses": losses}


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recorder = Recorder()
    for case in cases:
        torch.save(run(case, recorder, world), os.path.join(out, f"{case.replace(':', '_')}.rank{rank}.pt"))
    close_process_group()


if __name__ == "__main__":
    main()
