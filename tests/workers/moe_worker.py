"""One rank of a mixture-of-experts run: a small GPT-like model with a DeepSpeed ``MoE`` layer, trained under
several configs in one process group.

Usage (per rank, with RANK/WORLD_SIZE/MASTER_* set): python moe_worker.py OUT CASE [CASE...]
CASE = DTYPE:MODE:STAGE:EXPERTS:EP:K, e.g. fp32:stock:2:2:2:1 (2 experts, expert-parallel size 2, top-1
gating) or bf16:ts:1:2:1:2. MODE ``ts`` enables ds_tensorshard, ``tsmpi`` with the mpi comm backend;
``stock-reduce`` is stock with ``use_multi_rank_bucket_allreduce`` false (a reduce onto each owner). The
param groups are ``split_params_into_different_moe_groups_for_optimizer``'s. Writes OUT/CASE.rankR.pt with the
per-micro-step losses, the grad norms, the final parameters, their fp32 masters (``safe_get_full_fp32_param``)
and (ds_tensorshard) each domain's plan: elements per rank.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn

import ds_tensorshard  # noqa: F401  (registers the plugin)
from tests.helpers.emulated_accelerator import model_device, serve_cases
from tests.workers.equivalence_worker import ds_config

REDUCING_STOCK = "stock-reduce"
VOCAB, WIDTH, SEQ, MICRO_BATCH, GAS, STEPS = 64, 32, 8, 2, 2, 5


class MoEModel(nn.Module):
    """Embedding -> a dense layer -> a DeepSpeed MoE layer of small MLP experts -> head."""

    def __init__(self, experts: int, ep_size: int, k: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.dense = nn.Linear(WIDTH, WIDTH)
        expert = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.moe = MoE(WIDTH, expert, num_experts=experts, ep_size=ep_size, k=k, min_capacity=2)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        x = x + F.gelu(self.dense(x))
        moe_out, aux_loss, _ = self.moe(x)
        logits = self.head(self.ln(x + moe_out)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) + 0.01 * aux_loss


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only, then each group split into its dense and expert parts, as stock needs."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "name": "decay"}, {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def batch(rank: int, micro_step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * micro_step + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)


def run_case(case: str, out_dir: str) -> None:
    dtype, mode, stage, experts, ep_size, k = case.split(":")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(1234)
    with model_device():
        model = MoEModel(int(experts), int(ep_size), int(k))
    config = ds_config(dtype, mode, int(stage), world)
    config["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=1e-2)  # one lr for every group
    if mode == REDUCING_STOCK:  # stock reducing each partition onto its owner, as ds_tensorshard does
        config["zero_optimization"]["use_multi_rank_bucket_allreduce"] = False
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    losses, norms = [], []
    for micro in range(STEPS * GAS):
        torch.manual_seed(micro)  # the gate's random token selection draws the same numbers in every run
        loss = engine(batch(rank, micro).to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (micro + 1) % GAS == 0:
            norms.append(float(engine.get_global_grad_norm() or 0.0))
    result = {
        "losses": losses,
        "norms": norms,
        "skipped_steps": engine.skipped_steps,
        "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        "masters": {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()},
        "optimizer_class": type(optimizer).__name__,
    }
    if mode.startswith("ts"):
        result["numel_per_rank"] = {name: list(d.plan.numel_per_rank) for name, d in optimizer.domains.items()}
    torch.save(result, os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}.pt"))


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    serve_cases(run_case, out_dir, cases)  # EMULATED_CUDA=1: emulated CUDA under NCCL's rules


if __name__ == "__main__":
    main()
