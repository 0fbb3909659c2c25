"""What the framework examples (hf_trainer, accelerate_train, lightning_train, trl_dpo) share: the tiny Hugging Face
models they train, and how rank 0 reports a run (losses, optimizer class, final parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VOCAB, SEQ = 128, 16


def tiny_gpt2() -> PreTrainedModel:
    """A 2-layer GPT-2 of width 32, without dropout, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def tiny_llama() -> PreTrainedModel:
    """A 2-layer Llama of width 32 with grouped-query attention, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def gathered_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters by name, in fp32; at ZeRO-3 gathered first (a collective: call it on every rank)."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def report(
    losses: dict, optimizer: object, module: torch.nn.Module | dict, results: str | None, **extra: object
) -> None:
    """Rank 0: print the optimizer class and the losses; save them with the final parameters (``module``'s, or
    those given by name) and ``extra`` (an example's own entries) to ``results``."""
    print(f"optimizer {type(optimizer).__name__}; losses {losses}")
    if results:
        params = module if isinstance(module, dict) else gathered_parameters(module)
        saved = {"losses": losses, "optimizer_class": type(optimizer).__name__, "params": params, **extra}
        torch.save(saved, results)
