"""Model shapes the package plans and trains: a GPT-style language model (torch's
TransformerEncoderLayer, pre-norm, causal, tied head) in named sizes, and the parameter shapes of
Llama-style models, named or read from a Hugging Face ``config.json`` (Mixtral-style mixtures of experts,
each expert its own tensors, where it has ``num_local_experts``, and the ``mixtral-8x7b`` preset).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_tensorshard.errors import ModelSourceError

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
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
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


LORA_RANK = 16  # the adapters' rank: at width 128, 2,048 elements per adapter tensor


class LoRALayer(nn.Module):
    """A frozen square linear layer with a trainable low-rank adapter, pre-normed (no parameters) and residual:
    ``x + gelu(W h + B A h)``, ``h = layer_norm(x)``."""

    def __init__(self, width: int, rank: int = LORA_RANK) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) / math.sqrt(width))
        self.lora_b = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, x.shape[-1:])
        return x + F.gelu(self.base(h) + (h @ self.lora_a.t()) @ self.lora_b.t())


class LoRAStack(nn.Module):
    """A LoRA-like language model: a frozen base (embeddings, ``layers`` square linear layers, final norm,
    tied head) and two small trainable tensors per layer, its adapter's A and B."""

    def __init__(self, vocab: int, seq: int, width: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(LoRALayer(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for frozen in (self.wte, self.wpe, self.ln_f):
            frozen.requires_grad_(False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``tokens`` (batch, time), the head tied to the embedding."""
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


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


Shapes = list[tuple[str, tuple[int, ...]]]
LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
# Mixtral-8x7B's config.json: Llama-3-8B's layers, its vocabulary, 8 experts per MLP and 2 per token
LLAMA_PRESETS["mixtral-8x7b"] = dict(
    LLAMA_PRESETS["llama3-8b"], vocab_size=32000, num_local_experts=8, num_experts_per_tok=2
)
PRESET_NAMES = (*PRESETS, *LLAMA_PRESETS)


MOE_KEYS = ("num_local_experts", "num_experts_per_tok")  # Mixtral's; a config without them is dense
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture-of-experts model: ``count`` per MoE layer, ``per_token`` of them
    for each token (``num_local_experts``, ``num_experts_per_tok``)."""

    count: int
    per_token: int


def expert_index(name: str) -> int | None:
    """The expert a tensor belongs to (``...experts.3.w1.weight`` -> 3), or None for a tensor outside the experts."""
    found = _EXPERT.search(name)
    return int(found.group(1)) if found else None


def llama_shapes(config: Mapping[str, Any]) -> Shapes:
    """The trainable parameters of a Llama-style decoder (Hugging Face names), from its config keys; with
    ``num_local_experts``, Mixtral's: each layer's MLP is a router (``block_sparse_moe.gate``) and that many
    experts, each its own ``w1``/``w2``/``w3`` (the checkpoints' layout, and each expert-parallel rank's)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    experts = config.get("num_local_experts", 0)
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes += [
            (f"{layer}.self_attn.q_proj.weight", (h, h)),
            (f"{layer}.self_attn.k_proj.weight", (kv, h)),
            (f"{layer}.self_attn.v_proj.weight", (kv, h)),
            (f"{layer}.self_attn.o_proj.weight", (h, h)),
        ]
        if experts:
            moe = f"{layer}.block_sparse_moe"
            shapes.append((f"{moe}.gate.weight", (experts, h)))
            for e in range(experts):
                shapes += [
                    (f"{moe}.experts.{e}.w1.weight", (inter, h)),
                    (f"{moe}.experts.{e}.w2.weight", (h, inter)),
                    (f"{moe}.experts.{e}.w3.weight", (inter, h)),
                ]
        else:
            shapes += [
                (f"{layer}.mlp.gate_proj.weight", (inter, h)),
                (f"{layer}.mlp.up_proj.weight", (inter, h)),
                (f"{layer}.mlp.down_proj.weight", (h, inter)),
            ]
        shapes += [(f"{layer}.input_layernorm.weight", (h,)), (f"{layer}.post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, h)))
    return shapes


def hf_config_model(path: str) -> tuple[Shapes, Experts | None]:
    """Parameter shapes of the Llama-style model a Hugging Face ``config.json`` describes, and its experts (None
    for a dense model)."""
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ModelSourceError(f"{path} is not a JSON object")
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    config.setdefault("tie_word_embeddings", False)
    moe = "num_local_experts" in config
    for key in LLAMA_KEYS + (MOE_KEYS if moe else ()):
        value = config.get(key)
        if key == "tie_word_embeddings":
            if not isinstance(value, bool):
                raise ModelSourceError(f"{path}: '{key}' must be true or false, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelSourceError(f"{path}: '{key}' must be a positive integer, got {value!r}")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ModelSourceError(
            f"{path}: 'hidden_size' {config['hidden_size']} is not a multiple of "
            f"'num_attention_heads' {config['num_attention_heads']}"
        )
    if not moe:
        return llama_shapes(config), None
    experts = Experts(config["num_local_experts"], config["num_experts_per_tok"])
    if experts.per_token > experts.count:
        raise ModelSourceError(
            f"{path}: 'num_experts_per_tok' {experts.per_token} exceeds 'num_local_experts' {experts.count}"
        )
    return llama_shapes(config), experts


def preset_shapes(preset: str, **overrides: int) -> Shapes:
    """Trainable parameter shapes of a named model (GPT presets accept size overrides)."""
    if preset in LLAMA_PRESETS:
        if overrides:
            raise ModelSourceError(f"preset {preset} takes no size overrides (got {sorted(overrides)})")
        return llama_shapes(LLAMA_PRESETS[preset])
    model = build(preset, device="meta", **overrides)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]


def preset_experts(preset: str) -> Experts | None:
    """The experts of a named mixture-of-experts model (None for a dense one)."""
    config = LLAMA_PRESETS.get(preset, {})
    return Experts(config["num_local_experts"], config["num_experts_per_tok"]) if MOE_KEYS[0] in config else None


def total_numel(shapes: Shapes) -> int:
    return sum(math.prod(shape) for _, shape in shapes)
