"""Accelerate with DeepSpeed and ds_tensorshard. The one change to an Accelerate script is
``import ds_tensorshard`` (or launching it through ``python -m ds_tensorshard``); the DeepSpeed config file
gets a ``"tensorshard"`` block and keeps its ``"auto"`` values, which Accelerate fills:

    accelerate launch --use_deepspeed --deepspeed_config_file configs/accelerate_tensorshard.json \\
        --num_processes 2 -m ds_tensorshard.examples.accelerate_train --out runs/acc --save-at 3

A tiny Llama built from its config (random init, fixed seed; no model hub), random tokens, the same samples
in every step at any world size (sequential batches, global batch fixed by ``--grad-accum``).
``--resume DIR`` loads ``accelerator.save_state`` output and continues; ``--results FILE`` makes rank 0 save
per-step losses and the final parameters; ``--state-dict FILE`` makes the main process save
``accelerator.get_state_dict(model)`` there (at ZeRO-3 the 16-bit model gathered from every rank, which needs
``stage3_gather_16bit_weights_on_model_save``).
"""

from __future__ import annotations

import argparse
import os

import torch

import ds_tensorshard  # noqa: F401  (the one line: registers the plugin with DeepSpeed)
from ds_tensorshard.examples.framework_common import SEQ, VOCAB, gathered_parameters, report, tiny_llama

SAMPLES = 96


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="accelerator.save_state folder (step_N inside)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3, help="save state after this many steps")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=3, help="keep micro x accum x ranks fixed across resumes")
    parser.add_argument("--resume", help="a folder written by accelerator.save_state")
    parser.add_argument("--results", help="rank 0 saves losses and final parameters here")
    parser.add_argument("--state-dict", help="the main process saves accelerator.get_state_dict(model) here")
    args = parser.parse_args()

    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    model = tiny_llama()
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(7))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=args.micro_batch)
    # the config file's optimizer and scheduler blocks ("auto" values) are built by DeepSpeed
    optimizer = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step, losses = 0, {}
    if args.resume:
        accelerator.load_state(args.resume)
        step = int(os.path.basename(os.path.normpath(args.resume)).split("_")[-1])
        # Accelerate restores its micro-step counter from random_states_<rank>.pkl, one per saving process: at
        # another world size or accumulation the ranks would disagree on the boundary (and hang). Set it here.
        accelerator.step = step * args.grad_accum
    batches = accelerator.skip_first_batches(loader, step * args.grad_accum) if step else loader
    micro_losses = []
    for (batch,) in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        micro_losses.append(loss.detach())
        if accelerator.sync_gradients:
            step += 1
            mean = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean")
            losses[step] = mean.item()
            micro_losses = []
            if step == args.save_at and not args.resume:
                accelerator.save_state(os.path.join(args.out, f"step_{step}"))
            if step == args.steps:
                break
    params = gathered_parameters(model.module)  # every rank: a collective at ZeRO-3
    state = accelerator.get_state_dict(model) if args.state_dict else None  # every rank, as params
    if accelerator.is_main_process:
        report(losses, model.optimizer, params, args.results)
        if args.state_dict:
            torch.save(state, args.state_dict)
    accelerator.wait_for_everyone()
    from ds_tensorshard.transports.torch_comm import close_process_group

    close_process_group()


if __name__ == "__main__":
    main()
