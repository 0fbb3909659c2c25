"""One rank of a pipeline run: a 2-stage PipelineModule GPT whose embedding is tied to the head across stages.

python pipe_worker.py OUT CASE [CASE...] [--save DIR --save-at K] [--load DIR]
CASE = DTYPE:MODE (MODE stock or ts; ZeRO stage 1, the one stock allows with pipelines); --save applies
to the last case only. The global batch is 12 sequences per step whatever the data-parallel size, the
same 12 for step s. Writes OUT/CASE.rankR.pt: the loss per step and this stage's final parameters.
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.tiny_gpt import Block
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config

GLOBAL_BATCH, MICRO, STEPS, WIDTH, STAGES = 12, 2, 6, 32, 2


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02)
        self.wpe = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight) + self.wpe


def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embedding.weight)  # the tied embedding, used again as the output projection


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def build() -> PipelineModule:
    layers = [
        TiedLayerSpec("embed", Embedding),
        LayerSpec(Block, WIDTH, 2),
        LayerSpec(Block, WIDTH, 2),
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", Embedding, forward_fn=head),
    ]
    return PipelineModule(layers=layers, num_stages=STAGES, loss_fn=next_token_loss, partition_method="uniform")


def batches(step: int, dp_rank: int, dp_size: int):
    """This data-parallel rank's micro-batches of step ``step``: (input, label) pairs."""
    micro_batches = GLOBAL_BATCH // (MICRO * dp_size)
    for micro in range(micro_batches):
        first = (micro * dp_size + dp_rank) * MICRO
        tokens = torch.stack(
            [
                torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(10_000 * step + first + i))
                for i in range(MICRO)
            ]
        )
        yield tokens, tokens


def run_case(case: str, args: argparse.Namespace, save: bool) -> None:
    dtype, mode = case.split(":")
    torch.manual_seed(4321 if args.load else 1234)
    model = build()
    dp_size = torch.distributed.get_world_size() // STAGES
    config = ds_config(dtype, mode, 1, dp_size)
    config.update(gradient_accumulation_steps=GLOBAL_BATCH // (MICRO * dp_size), train_batch_size=GLOBAL_BATCH)
    config["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=1e-2)  # one param group
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if args.load:
        path, _ = engine.load_checkpoint(args.load)
        assert path is not None, f"nothing loaded from {args.load}"
    losses = {}
    while engine.global_steps < STEPS:
        step = engine.global_steps
        loss = engine.train_batch(data_iter=batches(step, engine.grid.get_data_parallel_rank(), dp_size))
        losses[step] = float(loss)
        if save and engine.global_steps == args.save_at:
            engine.save_checkpoint(args.save, tag=f"step{engine.global_steps}")
    torch.save(
        {
            "losses": losses,
            "optimizer_class": type(optimizer).__name__,
            "stage": engine.stage_id,
            "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        },
        os.path.join(args.out, f"{case.replace(':', '_')}.rank{torch.distributed.get_rank()}.pt"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--save")
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--load")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    for index, case in enumerate(args.cases):
        run_case(case, args, save=bool(args.save) and index == len(args.cases) - 1)
    close_process_group()


if __name__ == "__main__":
    main()
