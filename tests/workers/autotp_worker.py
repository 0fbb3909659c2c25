"""One rank of an AutoTP run (DeepSpeed's ``tensor_parallel.autotp_size``): an MLP whose linear layers the engine
shards itself (column- then row-parallel pairs, by ``partition_config`` patterns; the head replicated), trained with
stock ZeRO-1/2 or ds_tensorshard on TP x DP ranks.

python autotp_worker.py OUT TP CASE [CASE...]; CASE = DTYPE:MODE:STAGE (MODE stock, ts or ts-resume: saved after 3
steps and resumed in a new engine). Writes OUT/CASE.rankR.pt:
losses per step, grad norms, final parameters (this rank's shards) and the optimizer's class.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.utils import groups

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.workers.equivalence_worker import ds_config

WIDTH, HIDDEN, CLASSES, MICRO, GLOBAL_BATCH, STEPS = 32, 64, 8, 2, 8, 5
PARTITION = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*blocks\.\d+\.up\.weight$"], "partition_type": "column"},
        {"patterns": [r".*blocks\.\d+\.down\.weight$"], "partition_type": "row"},
    ],
}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(WIDTH, CLASSES)  # replicated on every tensor-parallel rank

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x).float(), y)


def sample(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + index)
    return torch.randn(WIDTH, generator=gen), torch.randint(0, CLASSES, (), generator=gen)


def build(dtype: str, mode: str, stage: int, tp: int, seed: int):
    dp = int(os.environ["WORLD_SIZE"]) // tp
    config = ds_config(dtype, mode, stage, dp)
    config.update(gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * dp), train_micro_batch_size_per_gpu=MICRO)
    del config["train_batch_size"]  # DeepSpeed's batch check counts the tensor-parallel ranks as data-parallel ones
    config["tensor_parallel"] = {"autotp_size": tp, "partition_config": PARTITION}
    torch.manual_seed(seed)
    model = MLP()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config, model_parameters=[{"params": decay}, {"params": other, "weight_decay": 0.0}]
    )
    return engine


def train(engine, steps: range, dtype: str, losses: list[float], norms: list[float]) -> None:
    dp, dp_rank, gas = (
        groups.get_data_parallel_world_size(),
        groups.get_data_parallel_rank(),
        engine.gradient_accumulation_steps(),
    )
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    for step in steps:
        total = torch.zeros(())
        for micro in range(gas):
            first = (micro * dp + dp_rank) * MICRO
            xs, ys = zip(*(sample(step, first + i) for i in range(MICRO)))
            loss = engine(torch.stack(xs).to(low), torch.stack(ys))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        losses.append(total.item())
        norms.append(float(engine.get_global_grad_norm() or 0.0))


def run_case(out: str, case: str, tp: int) -> None:
    """MODE ``ts-resume``: ds_tensorshard saved after 3 steps, loaded into a new engine, 2 more steps."""
    dtype, mode, stage = case.split(":")
    resume = mode == "ts-resume"
    engine = build(dtype, "ts" if resume else mode, int(stage), tp, 1234)
    losses: list[float] = []
    norms: list[float] = []
    if resume:
        train(engine, range(3), dtype, losses, norms)
        engine.save_checkpoint(os.path.join(out, f"ckpt_{dtype}_{stage}"))
        engine = build(dtype, "ts", int(stage), tp, 4321)
        path, _ = engine.load_checkpoint(os.path.join(out, f"ckpt_{dtype}_{stage}"))
        assert path is not None
        train(engine, range(3, STEPS), dtype, losses, norms)
    else:
        train(engine, range(STEPS), dtype, losses, norms)
    result = {
        "losses": losses,
        "norms": norms,
        "skipped_steps": engine.skipped_steps,
        "optimizer_class": type(engine.optimizer).__name__,
        "tp_layers": sorted({type(m).__name__ for m in engine.module.modules()}),
        "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
    }
    torch.save(result, os.path.join(out, f"{case.replace(':', '_')}.rank{os.environ['RANK']}.pt"))


def main() -> None:
    out, tp, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    for case in cases:
        run_case(out, case, tp)
    close_process_group()


if __name__ == "__main__":
    main()
