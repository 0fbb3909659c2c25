"""A PEFT LoRA fine-tune with ds_tensorshard: the base model frozen, only the LoRA adapters trained (and so
sharded: each adapter tensor is owned whole by one rank). The one change to the script is
``import ds_tensorshard``; the DeepSpeed config has a ``"tensorshard"`` block next to ZeRO stage 2. A tiny GPT-2
built from its config (random init, fixed seed; no model hub) stands in for the pretrained base; random tokens.

    deepspeed --num_gpus 2 --module ds_tensorshard.examples.peft_lora                      # or torchrun
    ... --checkpointing reentrant     # with Transformers' activation checkpointing (PEFT makes the inputs require grad)

``--stock`` drops the tensorshard block (stock ZeRO-2); ``--results FILE`` makes rank 0 save the per-step
losses (the mean over ranks) and the final parameters, the frozen ones included. ``--stage 3`` runs ZeRO-3, the
base built inside ``deepspeed.zero.Init`` with the engine's config (as ``from_pretrained`` builds it), so that PEFT
wraps layers whose weights are already kept by their owners.
"""

from __future__ import annotations

import argparse
import contextlib

import deepspeed
import torch
from deepspeed import comm as dist

import ds_tensorshard  # noqa: F401  (the one line: registers the plugin with DeepSpeed)
from ds_tensorshard.examples.framework_common import SEQ, VOCAB, gathered_parameters, report, tiny_gpt2

LORA_MODULES = ["c_attn", "c_proj", "c_fc"]  # GPT-2's attention and MLP projections (Conv1D layers)


def ds_config(stock: bool, micro_batch: int, grad_accum: int, world: int, stage: int = 2) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-3, "warmup_num_steps": 2},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "steps_per_print": 1000,
    }
    if not stock:
        config["tensorshard"] = {"enabled": True}
    return config


def lora_model(checkpointing: str, init_config: dict | None = None) -> torch.nn.Module:
    """The frozen base with LoRA adapters (rank 4) on every projection; ``checkpointing`` "non_reentrant" or
    "reentrant" turns on Transformers' activation checkpointing first, as a user does before get_peft_model. With
    ``init_config`` (ZeRO-3) the base is built inside ``deepspeed.zero.Init`` with that config."""
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    building = deepspeed.zero.Init(config_dict_or_path=init_config) if init_config else contextlib.nullcontext()
    with building:
        base = tiny_gpt2()
    assert isinstance(base, PreTrainedModel)
    if checkpointing != "none":
        base.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    torch.manual_seed(1)  # the adapters' own initialization
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_MODULES, fan_in_fan_out=True)
    model = get_peft_model(base, config)
    model.train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable), trainable
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=3)
    parser.add_argument("--checkpointing", choices=["none", "non_reentrant", "reentrant"], default="none")
    parser.add_argument("--stock", action="store_true", help="stock ZeRO (no tensorshard block)")
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--results", help="rank 0 saves losses and final parameters here")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ds_config(args.stock, args.micro_batch, args.grad_accum, world, args.stage)
    model = lora_model(args.checkpointing, config if args.stage == 3 else None)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    initial = gathered_parameters(engine.module)  # every rank: a collective at ZeRO-3
    generator = torch.Generator().manual_seed(1000 + rank)
    losses: dict[int, float] = {}
    for micro in range(args.steps * args.grad_accum):
        tokens = torch.randint(0, VOCAB, (args.micro_batch, SEQ), generator=generator).to(engine.device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        if (micro + 1) % args.grad_accum == 0:  # a step just ended: its last micro-step's loss, averaged over ranks
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses[engine.global_steps] = mean.item() / world
    params = gathered_parameters(engine.module)  # every rank: a collective at ZeRO-3
    if rank == 0:
        report(losses, optimizer, params, args.results, initial=initial)
    from ds_tensorshard.transports.torch_comm import close_process_group

    close_process_group()


if __name__ == "__main__":
    main()
