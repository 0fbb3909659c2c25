"""A small GPT-style model for the equivalence tests: tied embeddings, a frozen and an unused parameter, and
optionally each block under activation checkpointing."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

# TinyGPT(checkpointing=...): how each block is recomputed in backward (each block's parameters used once)
CHECKPOINTING = ("non_reentrant", "reentrant", "deepspeed")


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.mlp(x)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The attention half, with its residual."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, c))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half, without its residual (row by row: DeepSpeed's ``TiledMLP`` can shard it)."""
        return self.out(F.gelu(self.fc(self.ln2(x))))


def checkpointed(block: nn.Module, x: torch.Tensor, how: str) -> torch.Tensor:
    """``block(x)``, its activations recomputed in backward: torch's checkpoint without or with reentrant
    autograd, or DeepSpeed's own (``deepspeed.checkpointing.checkpoint``, reentrant)."""
    if how == "deepspeed":
        import deepspeed

        return deepspeed.checkpointing.checkpoint(block, x)
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=how == "reentrant")


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        layers: int = 2,
        heads: int = 2,
        seq: int = 16,
        checkpointing: str | None = None,
    ) -> None:
        super().__init__()
        assert checkpointing in (None, *CHECKPOINTING), checkpointing
        self.checkpointing = checkpointing
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.frozen_scale = nn.Parameter(torch.full((width,), 0.5), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(8, width) * 0.02)  # never touched by forward
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos) + self.frozen_scale
        for block in self.blocks:  # the blocks' input requires grad (the embedding trains), as reentrant needs
            x = block(x) if self.checkpointing is None else checkpointed(block, x, self.checkpointing)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
