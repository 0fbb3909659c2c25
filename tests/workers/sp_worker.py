"""One rank of a sequence-parallel run: DeepSpeed's Ulysses DistributedAttention, sequence x data parallel.

python sp_worker.py OUT SP CASE [CASE...]   CASE = DTYPE:MODE:STAGE (MODE stock, ts, tsmpi)
Ranks form a grid ``rank = dp_rank * sp + sp_rank``; each rank of a sequence-parallel group holds a
slice of every sequence. Writes OUT/CASE.rankR.pt: losses, grad norms and the final parameters.
"""

from __future__ import annotations

import math
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch import nn

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.workers.equivalence_worker import ds_config

VOCAB, SEQ, WIDTH, HEADS, MICRO, GAS, STEPS = 64, 16, 32, 4, 2, 2, 5


class SequenceParallelMpu:
    """DeepSpeed's mpu interface for sequence x data parallelism (no tensor parallelism)."""

    def __init__(self, sp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.sp, self.dp = sp, world // sp
        self.sp_rank, self.dp_rank = rank % sp, rank // sp
        for d in range(self.dp):
            ranks = [d * sp + s for s in range(sp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.sp_group = group
        for s in range(sp):
            ranks = [d * sp + s for d in range(self.dp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = group
        for r in range(world):
            group = dist.new_group([r])
            if r == rank:
                self.mp_group = group
        self.seq_dp_group = dist.new_group(list(range(world)))

    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.seq_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sp * self.dp

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


class LocalAttention(nn.Module):
    """Causal attention over the whole sequence, for the heads this rank holds: [s, b, h, d] in and out."""

    def forward(self, q, k, v, *args, **kwargs):
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.einsum("bhst,tbhd->sbhd", attn, v)


class UlyssesGPT(nn.Module):
    def __init__(self, mpu: SequenceParallelMpu) -> None:
        super().__init__()
        self.mpu = mpu
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.attention = DistributedAttention(LocalAttention(), mpu.sp_group, scatter_idx=2, gather_idx=0)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: [batch, SEQ / sp], this rank's slice of each sequence."""
        b, s = tokens.shape
        positions = torch.arange(s) + self.mpu.sp_rank * s
        x = (self.wte(tokens) + self.wpe(positions)).transpose(0, 1)  # [s, b, width]
        q, k, v = (t.reshape(s, b, HEADS, WIDTH // HEADS) for t in self.qkv(self.ln1(x)).split(WIDTH, dim=-1))
        x = x + self.proj(self.attention(q, k, v, batch_dim_idx=1).reshape(s, b, WIDTH))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(x).transpose(0, 1)  # [b, s, vocab]
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(mpu: SequenceParallelMpu, micro_step: int) -> torch.Tensor:
    full = torch.randint(
        0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1000 * micro_step + mpu.dp_rank)
    )
    return full.chunk(mpu.sp, dim=1)[mpu.sp_rank]


def run_case(case: str, mpu: SequenceParallelMpu, out: str) -> None:
    dtype, mode, stage = case.split(":")
    config = ds_config(dtype, mode, int(stage), mpu.dp)
    config["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=1e-2)  # one param group
    torch.manual_seed(1234)
    model = UlyssesGPT(mpu)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=mpu
    )
    losses, norms = [], []
    for micro in range(STEPS * GAS):
        loss = engine(batch(mpu, micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (micro + 1) % GAS == 0:
            norms.append(float(engine.get_global_grad_norm() or 0.0))
    torch.save(
        {
            "losses": losses,
            "norms": norms,
            "skipped_steps": engine.skipped_steps,
            "optimizer_class": type(optimizer).__name__,
            "communication_dtype": str(engine.communication_data_type),
            "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        },
        os.path.join(out, f"{case.replace(':', '_')}.rank{dist.get_rank()}.pt"),
    )


def main() -> None:
    out, sp, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    mpu = SequenceParallelMpu(sp)
    for case in cases:
        run_case(case, mpu, out)
    close_process_group()


if __name__ == "__main__":
    main()
