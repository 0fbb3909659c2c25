"""One rank of a run with a module that casts its own parameters in every forward (as Switch Transformers'
router casts itself to fp32): stock ZeRO-1/2 and ds_tensorshard in each layout, bf16, clipping 0.5.

Usage (per rank, with RANK/WORLD_SIZE/MASTER_* set): python recast_worker.py OUT CASE [CASE...]
CASE = MODE:STAGE:GAS, MODE ``stock`` or a ``tensorshard.bucket_layout`` (``windows``, ``stripes``, ``flat``).
Writes OUT/CASE.rankR.pt: the losses, the global norm after each step, the router's dtype after each forward
and the final parameters.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.emulated_accelerator import init_worker

STEPS, CLIP = 5, 0.5  # clipping: the norm each step (about 0.6-1.0 here) decides the update


class CastingRouter(torch.nn.Module):
    """A layer and a router that casts itself to fp32 in every forward, as Switch Transformers' router does."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.router = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.router = self.router.to(torch.float32)  # bf16 parameters: .data replaced by an fp32 copy
        return self.router(self.body(x).float()).square().mean()


def train_case(case: str, world: int, rank: int) -> dict:
    """Train CASE on this rank of ``world``: its losses, norms, the router's dtype after each forward, parameters."""
    mode, stage, gas = case.split(":")
    block = {"enabled": False} if mode == "stock" else {"enabled": True, "bucket_layout": mode}
    config = {
        "train_batch_size": 2 * int(gas) * world,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": int(stage)},
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "tensorshard": block,
    }
    torch.manual_seed(0)
    model = CastingRouter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, norms, router = [], [], []
    for micro in range(STEPS * int(gas)):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(micro * 10 + rank)).to(torch.bfloat16)
        loss = engine(x)
        router.append(str(model.router.weight.dtype))
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        if boundary:
            norms.append(float(engine.get_global_grad_norm()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "router": router, "params": params}


def run_case(case: str, out_dir: str) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    result = train_case(case, world, rank)
    torch.save(result, os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}.pt"))


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    init_worker()
    for case in cases:
        run_case(case, out_dir)
    close_process_group()


if __name__ == "__main__":
    main()
