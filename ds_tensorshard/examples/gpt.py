"""A GPT-style language model built from torch's TransformerEncoderLayer (pre-norm, causal), tied head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {
    "demo": dict(vocab=256, seq=64, width=128, layers=4, heads=4),
    "gpt2-small": dict(vocab=50257, seq=1024, width=768, layers=12, heads=12),
}


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``tokens`` (batch, time)."""
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build(preset: str = "demo", device: str | torch.device = "cpu", **overrides: int) -> GPT:
    """A model of a named shape; ``device="meta"`` gives shapes without allocating memory."""
    with torch.device(device):
        return GPT(**{**PRESETS[preset], **overrides})


def synthetic_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences following ``x[t+1] = (3 * x[t] + 1) % vocab`` from random starts: learnable, so loss falls."""
    tokens = torch.empty(batch, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for t in range(1, seq):
        tokens[:, t] = (3 * tokens[:, t - 1] + 1) % vocab
    return tokens
