"""A toy model-parallel unit (DeepSpeed's ``mpu`` interface) and a small tensor-parallel GPT for the tests.

Ranks form a grid ``rank = dp_rank * tp_size + tp_rank``. The model has column-parallel and
row-parallel linears (their shards marked ``tensor_model_parallel``, as Megatron marks them) and
replicated embeddings, norms and head; it computes exactly what the unsharded model computes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ToyMpu:
    """DeepSpeed's mpu interface over a tensor-parallel x data-parallel grid."""

    def __init__(self, tp_size: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        assert world % tp_size == 0, (world, tp_size)
        self.tp_size, self.dp_size = tp_size, world // tp_size
        self.tp_rank, self.dp_rank = rank % tp_size, rank // tp_size
        for d in range(self.dp_size):  # every rank creates every group, in the same order
            ranks = [d * tp_size + t for t in range(tp_size)]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        for t in range(tp_size):
            ranks = [d * tp_size + t for d in range(self.dp_size)]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_src_rank(self) -> int:
        return self.tp_ranks[0]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The partial outputs are summed over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard(full: torch.Tensor, dim: int, mpu: ToyMpu) -> nn.Parameter:
    param = nn.Parameter(full.chunk(mpu.tp_size, dim=dim)[mpu.tp_rank].clone())
    param.tensor_model_parallel = True
    return param


class TPBlock(nn.Module):
    """Pre-norm MLP block: column-parallel fc (weight and bias split by output), row-parallel out."""

    def __init__(self, width: int, mpu: ToyMpu) -> None:
        super().__init__()
        self.mpu = mpu
        self.ln = nn.LayerNorm(width)
        self.fc_weight = _shard(torch.randn(4 * width, width) * 0.02, 0, mpu)
        self.fc_bias = _shard(torch.zeros(4 * width), 0, mpu)
        self.out_weight = _shard(torch.randn(width, 4 * width) / math.sqrt(4 * width), 1, mpu)
        self.out_bias = nn.Parameter(torch.zeros(width))  # replicated, added after the reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CopyToTensorParallel.apply(self.ln(x), self.mpu.tp_group)
        h = F.gelu(F.linear(h, self.fc_weight, self.fc_bias))
        return x + _ReduceFromTensorParallel.apply(F.linear(h, self.out_weight), self.mpu.tp_group) + self.out_bias


class TPGPT(nn.Module):
    """Replicated embeddings, norm and head around tensor-parallel blocks; same seed on every rank."""

    def __init__(self, mpu: ToyMpu, vocab: int = 64, width: int = 32, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(TPBlock(width, mpu) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
