"""TRL's ``DPOTrainer`` with a frozen reference model, on DeepSpeed ZeRO-2 with ds_tensorshard. As with any
Accelerate script, the one change is ``import ds_tensorshard`` (or launching it through
``python -m ds_tensorshard``), and the DeepSpeed config file gets a ``"tensorshard"`` block:

    accelerate launch --use_deepspeed --deepspeed_config_file configs/accelerate_tensorshard.json \\
        --num_processes 2 -m ds_tensorshard.examples.trl_dpo --out runs/dpo --results runs/dpo/results.pt

Two engines are built from that one config. The policy's (ZeRO-2, the config's AdamW) gets
``TensorShardOptimizer``. TRL builds the reference model's engine itself (``trl.models.utils.prepare_deepspeed``)
from a copy of the config with the optimizer and scheduler blocks dropped and ``zero_optimization.stage`` set to
0; the block it keeps has nothing to replace there, so that engine runs as stock DeepSpeed. Rank 0 logs one line
saying so.

A tiny Llama built from its config twice with the same seed (policy and reference start equal; no model hub), a
word-level tokenizer built here with ``tokenizers``, and an in-memory preference dataset: each prompt is a run of
counting words, the chosen completion counts on, the rejected one is random words. Sequential batches, so that
a step sees the same pairs at any world size. ``--results FILE`` makes rank 0 save the logged losses, the final
policy parameters and what the reference engine is.

At ZeRO-3 (the config's ``zero_optimization.stage`` 3) TRL builds the reference engine at stage 3 too, without an
optimizer: DeepSpeed makes it ``DeepSpeedZeRoOffload`` alone, which ds_tensorshard leaves stock. ``--generate``
then ends with a generation step as GRPO takes it (``trl.models.utils.unwrap_model_for_generation``: the policy's
parameters gathered, the stage-3 hooks removed and put back) and one more loss from the policy's engine (its hooks
working again), both saved to the results.
"""

from __future__ import annotations

import argparse
import os
import random

import torch

import ds_tensorshard  # noqa: F401  (the one line: registers the plugin with DeepSpeed)
from ds_tensorshard.examples.framework_common import SEQ, VOCAB, gathered_parameters, report, tiny_llama

PAIRS = 96  # 8 steps of 2 ranks x 2 pairs x 3 accumulation
SPECIAL = ("<pad>", "<eos>", "<unk>")
WORDS = [f"n{i}" for i in range(VOCAB - len(SPECIAL))]


def word_tokenizer():
    """A fast tokenizer over SPECIAL + WORDS (one id per word, split on whitespace), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def preference_pairs(n: int = PAIRS, seed: int = 7):
    """``n`` prompt/chosen/rejected rows (plain text; TRL appends the EOS token to both completions). A prompt and
    its completions fit in SEQ tokens: prompt 3-6 words, completions 2-4 words and EOS."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        length, answer = rng.randint(3, 6), rng.randint(2, 4)
        start = rng.randrange(len(WORDS) - length - answer)
        rows["prompt"].append(" ".join(WORDS[start : start + length]))
        rows["chosen"].append(" " + " ".join(WORDS[start + length : start + length + answer]))
        rows["rejected"].append(" " + " ".join(rng.choice(WORDS) for _ in range(answer)))
    return Dataset.from_dict(rows)


def generation_step(trainer) -> dict:
    """Greedy generation from the trained policy as GRPO runs it (``unwrap_model_for_generation``), then the
    policy's engine's loss on the same prompts (its hooks put back): the generated ids and that loss."""
    from trl.models.utils import unwrap_model_for_generation

    tokenizer = word_tokenizer()
    tokenizer.padding_side = "left"
    prompts = tokenizer(list(preference_pairs(4)["prompt"]), return_tensors="pt", padding=True)
    engine = trainer.model_wrapped
    engine.eval()
    with torch.no_grad():
        with unwrap_model_for_generation(engine, trainer.accelerator) as unwrapped:
            ids = unwrapped.generate(**prompts, max_new_tokens=4, do_sample=False, pad_token_id=0)
        loss = engine(
            input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"], labels=prompts["input_ids"]
        ).loss
    return {"generated": ids, "loss_after_generation": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the trainer's output_dir (nothing is saved there)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=3)
    parser.add_argument("--results", help="rank 0 saves losses, final parameters and the reference engine's kind")
    parser.add_argument("--generate", action="store_true", help="end with a generation step (as GRPO's)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub from rank 0 otherwise

    import deepspeed
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-2,
        weight_decay=0.01,
        max_grad_norm=1.0,
        warmup_steps=2,
        logging_steps=1,
        beta=0.1,
        max_length=SEQ,
        bf16=False,  # TRL's default is bf16; the comparison with stock is in fp32
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    policy, reference = tiny_llama(), tiny_llama()  # the same seed: the reference is the policy's starting point
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=config,
        train_dataset=preference_pairs(),
        processing_class=word_tokenizer(),
    )
    trainer.train()
    engine, ref_engine = trainer.model_wrapped, trainer.ref_model
    assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
    assert isinstance(ref_engine, deepspeed.DeepSpeedEngine), type(ref_engine)
    generated = generation_step(trainer) if args.generate else {}
    # every rank (collectives at ZeRO-3); the reference stayed frozen: bit for bit the policy's starting point
    params, ref_params = gathered_parameters(engine.module), gathered_parameters(ref_engine.module)
    ref_unchanged = all(torch.equal(start[n], p) for n, p in ref_params.items())
    if trainer.is_world_process_zero():
        history = [row for row in trainer.state.log_history if "loss" in row]
        report(
            {row["step"]: row["loss"] for row in history},
            engine.optimizer,
            params,
            args.results,
            margins={row["step"]: row["rewards/margins"] for row in history},
            ref_optimizer_class=type(ref_engine.optimizer).__name__,
            ref_zero_stage=ref_engine.zero_optimization_stage(),
            ref_unchanged=ref_unchanged,
            **generated,
        )
    from ds_tensorshard.transports.torch_comm import close_process_group

    close_process_group()


if __name__ == "__main__":
    main()
