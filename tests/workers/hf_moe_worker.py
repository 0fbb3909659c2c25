"""One rank of an HF mixture-of-experts run: a tiny transformers MoE model, stock ZeRO-1/2 or ds_tensorshard.

Usage (per rank, RANK/WORLD_SIZE/MASTER_* set): python hf_moe_worker.py OUT CASE [CASE...]
CASE = MODEL:DTYPE:MODE:STAGE, e.g. switch:fp32:ts:2. MODE ``stock`` or ``ts`` (ds_tensorshard), either with
``+zeros`` (every expert parameter given a gradient, see :func:`run_case`). MODEL (``mixtral``, ``qwen2_moe``,
``qwen3_moe``, ``switch``) is built from its transformers config with a seeded random init: ``mixtral`` and the
Qwen MoEs keep their experts in 3D tensors (an expert without tokens gets a zero slice of the gradient),
``switch`` (Switch Transformers) keeps each expert a module of its own (an expert without tokens on a rank has
no gradient there: its hooks never fire on that rank). Few tokens per micro-batch (8 experts, 8 tokens) leave
experts idle in most steps.
Writes OUT/CASE.rankR.pt with per-micro-step losses, per-step grad norms, the final parameters and the
tokens each expert received, per micro-step and MoE layer.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group

MICRO_BATCH, GAS, STEPS, SEQ, VOCAB, EXPERTS = 1, 2, 5, 8, 64, 8


def build(model: str) -> tuple[torch.nn.Module, list[tuple[str, torch.nn.Module]]]:
    """The model from its config (seeded random init), and its expert containers by name."""
    import transformers  # here: the test module imports this one's constants without the frameworks extra

    decoder = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    decoder.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    if model == "mixtral":
        config = transformers.MixtralConfig(
            **decoder, num_local_experts=EXPERTS, num_experts_per_tok=2, router_jitter_noise=0.0
        )
        net: torch.nn.Module = transformers.MixtralForCausalLM(config)
    elif model == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **decoder, num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=48, decoder_sparse_step=1,
        )  # fmt: skip
        net = transformers.Qwen2MoeForCausalLM(config)
    elif model == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **decoder, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=24,
            decoder_sparse_step=1,
        )  # fmt: skip
        net = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=EXPERTS, expert_capacity=SEQ, encoder_sparse_step=1, decoder_sparse_step=1,
            router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        net = transformers.SwitchTransformersForConditionalGeneration(config)
    experts = [(n, m) for n, m in net.named_modules() if n.endswith(".experts")]
    assert experts, f"{model}: no expert containers"
    return net, experts


def tokens_per_expert(inputs: tuple) -> list[int]:
    """Tokens routed to each expert, from the expert container's arguments: (hidden, routing, weights), the
    routing as top-k indices (Mixtral, Qwen) or one-hot (tokens, 1, experts) with dropped tokens zero
    (Switch)."""
    routing = inputs[1]
    if routing.dtype.is_floating_point or routing.dim() == 3:
        return [int(c) for c in routing.reshape(-1, EXPERTS).sum(0).tolist()]
    return torch.bincount(routing.reshape(-1), minlength=EXPERTS).tolist()


def ds_config(dtype: str, mode: str, stage: int, world: int) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO_BATCH * GAS * world,
        # bf16 unclipped: the global norm differs from stock's by an fp32 ulp or two (its partials cover other
        # elements, README), and clipping turns that into a bf16 ulp on some parameters (measured on Mixtral with
        # clipping 1.0: parameters within 1.9e-6, losses equal), which a router may turn into another decision
        "gradient_clipping": 1.0 if dtype == "fp32" else 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if mode.startswith("ts"):
        config["tensorshard"] = {"enabled": True}
    return config


def batch(rank: int, micro_step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * micro_step + rank)
    return torch.randint(1, VOCAB, (MICRO_BATCH, SEQ), generator=gen)


def run_case(case: str, out_dir: str) -> None:
    model_name, dtype, mode, stage = case.split(":")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(1234)
    model, experts = build(model_name)
    routed: list[list[list[int]]] = []  # per micro-step, per MoE layer: tokens per expert
    for _, container in experts:
        container.register_forward_pre_hook(lambda module, inputs: routed[-1].append(tokens_per_expert(inputs)))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(dtype, mode, int(stage), world)
    )
    # stock ZeRO-1/2 fails where an expert has a gradient on one rank only, or where gradients become final in
    # another order on another rank (its buckets fill in that order). ``stock+zeros`` adds 0 x the sum of every
    # expert parameter, computed before the forward: each expert's gradient then becomes final at the end of
    # backward, in the same order on every rank, and is zero where the expert received no tokens
    touched = [p for _, c in experts for p in c.parameters()] if mode.endswith("+zeros") else []
    losses, norms = [], []
    for micro in range(STEPS * GAS):
        routed.append([])
        ids = batch(rank, micro).to(engine.device)
        zeros = 0.0 * sum(p.sum() for p in touched) if touched else None  # before the forward: last in backward
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss if zeros is None else loss + zeros)
        engine.step()
        losses.append(loss.item())
        if (micro + 1) % GAS == 0:
            norms.append(float(engine.get_global_grad_norm() or 0.0))
    result = {
        "losses": losses,
        "norms": norms,
        "skipped_steps": engine.skipped_steps,
        "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        "routed": routed,
        "experts": [n for n, _ in experts],
        "optimizer_class": type(optimizer).__name__,
    }
    torch.save(result, os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}.pt"))


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=int(os.environ.get("MASTER_PORT", "29500")))
    for case in cases:
        run_case(case, out_dir)
    close_process_group()


if __name__ == "__main__":
    main()
