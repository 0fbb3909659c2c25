"""HF Transformers ``Trainer`` with ds_tensorshard: the one change is ``import ds_tensorshard`` (or running the
script through ``python -m ds_tensorshard``); the DeepSpeed config dict given to ``TrainingArguments`` has a
``"tensorshard"`` block. A tiny GPT-2 built from its config (random init, fixed seed; no model hub), random
tokens, sequential batches so that a step sees the same samples at any world size.

    deepspeed --num_gpus 2 --module ds_tensorshard.examples.hf_trainer --out runs/hf       # or torchrun
    ... --resume runs/hf/checkpoint-3 --grad-accum 2                                       # resume at 3 ranks

``--stock`` drops the tensorshard block (stock ZeRO-2); ``--offload`` uses the Hugging Face DeepSpeed guide's
ZeRO-2 config instead (ZeRO-Offload: ``offload_optimizer`` cpu with pinned memory, "auto" values that the Trainer
fills); ``--results FILE`` makes rank 0 save the logged losses and the final parameters.

``--stage 3`` takes the guide's ZeRO-3 config (without its offload blocks unless ``--offload``;
``stage3_gather_16bit_weights_on_model_save`` on) and loads the model as ZeRO-3 users do:
``GPT2LMHeadModel.from_pretrained`` of the tiny GPT-2, saved first under ``OUT/tiny-gpt2`` (built inside
``deepspeed.zero.Init``, its weights loaded through ``GatheredParameters``), ``resize_token_embeddings`` and
gradient checkpointing; the Trainer saves the final model (``save_model``: ``save_16bit_model``) in ``OUT``.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (the one line: registers the plugin with DeepSpeed)
from ds_tensorshard.examples.framework_common import SEQ, VOCAB, gathered_parameters, report, tiny_gpt2

SAMPLES = 96


def hf_guide_zero2_offload() -> dict:
    """The ZeRO-2 config of Hugging Face's DeepSpeed guide, as users copy it (ZeRO-Offload to the CPU)."""
    return {
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "contiguous_gradients": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def hf_guide_zero3(offload: bool) -> dict:
    """The ZeRO-3 config of Hugging Face's DeepSpeed guide ("auto" values the Trainer fills from the model and its
    arguments); its ``offload_optimizer`` and ``offload_param`` blocks (cpu, pinned) only with ``offload``."""
    config = hf_guide_zero2_offload()
    zero: dict = {"stage": 3}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero.update(
        overlap_comm=True,
        contiguous_gradients=True,
        sub_group_size=1e9,
        reduce_bucket_size="auto",
        stage3_prefetch_bucket_size="auto",
        stage3_param_persistence_threshold="auto",
        stage3_max_live_parameters=1e9,
        stage3_max_reuse_distance=1e9,
        stage3_gather_16bit_weights_on_model_save=True,
    )
    config["zero_optimization"] = zero
    return config


def ds_config(stock: bool, offload: bool = False, stage: int = 2) -> dict:
    """What an HF user writes: "auto" where TrainingArguments decides, a ZeRO-2 block (the guide's ZeRO-Offload
    one with ``offload``; the guide's ZeRO-3 config at ``stage`` 3), the tensorshard block."""
    if stage == 3 or offload:
        config = hf_guide_zero3(offload) if stage == 3 else hf_guide_zero2_offload()
        if not stock:
            config["tensorshard"] = {"enabled": True}
        return config
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000},
    }
    if not stock:
        config["tensorshard"] = {"enabled": True}
    return config


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, n: int = SAMPLES) -> None:
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="Trainer output_dir (checkpoint-N folders)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=3, help="keep micro x accum x ranks fixed across resumes")
    parser.add_argument("--resume", help="a checkpoint-N folder to resume from")
    parser.add_argument("--stock", action="store_true", help="stock ZeRO (no tensorshard block)")
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2, help="3: the guide's ZeRO-3 config")
    parser.add_argument("--offload", action="store_true", help="the HF guide's config with CPU offload")
    parser.add_argument("--results", help="rank 0 saves losses and final parameters here")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def pretrained(training, out: str) -> torch.nn.Module:
    """ZeRO-3 as users load a model: the tiny GPT-2 saved under ``OUT/tiny-gpt2`` (by the main process, first),
    then ``from_pretrained`` (inside ``deepspeed.zero.Init``, since ``training`` enables ZeRO-3), its vocabulary
    grown by 8 rows, gradient checkpointing on."""
    import os

    from transformers import GPT2LMHeadModel

    folder = os.path.join(out, "tiny-gpt2")
    with training.main_process_first(desc="saving the tiny GPT-2"):
        if not os.path.exists(os.path.join(folder, "config.json")):
            tiny_gpt2().save_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder)
    torch.manual_seed(1)  # the new rows' values (mean-resizing samples them)
    model.resize_token_embeddings(VOCAB + 8)
    return model


def main() -> None:
    args = parse_args()
    from transformers import Trainer, TrainingArguments

    training = TrainingArguments(
        output_dir=args.out,
        deepspeed=ds_config(args.stock, args.offload, args.stage),
        max_steps=args.steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-2,
        weight_decay=0.01,
        max_grad_norm=1.0,
        warmup_steps=2,
        logging_steps=1,
        train_sampling_strategy="sequential",
        save_only_model=False,
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=args.stage == 3,
    )
    model = pretrained(training, args.out) if args.stage == 3 else tiny_gpt2()
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=args.resume)
    if args.stage == 3:
        trainer.save_model()  # the final model in OUT: save_16bit_model's state dict, written by the main process
    engine = trainer.model_wrapped
    assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
    params = gathered_parameters(engine.module)  # every rank: a collective at ZeRO-3
    if trainer.is_world_process_zero():
        losses = {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}
        inner = type(engine.optimizer.optimizer).__name__
        report(losses, engine.optimizer, params, args.results, inner_class=inner)
    from ds_tensorshard.transports.torch_comm import close_process_group

    close_process_group()


if __name__ == "__main__":
    main()
