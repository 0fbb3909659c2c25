"""PyTorch Lightning's ``DeepSpeedStrategy`` with ds_tensorshard. The one change is ``import ds_tensorshard``
(or ``python -m ds_tensorshard train.py``); the config given to ``DeepSpeedStrategy(config=...)`` gets a
``"tensorshard"`` block:

    python -m ds_tensorshard.examples.lightning_train --devices 2 --out runs/pl          # Lightning starts the ranks
    python -m ds_tensorshard.examples.lightning_train --devices 4 --micro-batch 1 --resume runs/pl/step3.ckpt

A tiny GPT-2 built from its config (random init, fixed seed; no model hub), random tokens, sequential
batches, so a step sees the same samples at any world size (global batch fixed by ``--grad-accum``). An epoch
is ``--save-at`` steps; Lightning's ModelCheckpoint saves at each epoch's end (``step<N>.ckpt``).
Lightning's DeepSpeedStrategy runs on CUDA GPUs (``--accelerator gpu``); on CPUs it refuses with "only
supported on CUDA GPUs" (the tests lift that one check, see tests/helpers/cpu_site). ``--stage 3``: ZeRO-3
(the config's stage, as ``DeepSpeedStrategy(stage=3)`` writes it).
"""

from __future__ import annotations

import argparse

import torch

import ds_tensorshard  # noqa: F401  (the one line: registers the plugin with DeepSpeed)
from ds_tensorshard.examples.framework_common import SEQ, VOCAB, gathered_parameters, report, tiny_gpt2


def ds_config(stock: bool, stage: int = 2) -> dict:
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 20000}}
    if not stock:
        config["tensorshard"] = {"enabled": True}
    return config


def build_module(lr: float = 1e-2):
    import lightning.pytorch as pl

    class TinyGPT2(pl.LightningModule):
        """GPT-2 from a config; AdamW from configure_optimizers (a client optimizer DeepSpeed wraps)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()
            self.losses: dict[int, list[float]] = {}

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = self.model(input_ids=tokens, labels=tokens).loss
            self.losses.setdefault(self.global_step + 1, []).append(loss.detach())
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01)
            warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return TinyGPT2()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where step<N>.ckpt (a DeepSpeed checkpoint folder) goes")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3, help="steps per epoch; a checkpoint at each epoch's end")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=3, help="keep micro x accum x ranks fixed across resumes")
    parser.add_argument("--resume", help="a step<N>.ckpt written by this example")
    parser.add_argument("--stock", action="store_true", help="stock ZeRO (no tensorshard block)")
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--results", help="rank 0 saves losses and final parameters here")
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy

    saver = ModelCheckpoint(
        dirpath=args.out,
        filename="step{step}",
        auto_insert_metric_name=False,
        save_top_k=-1,
        every_n_epochs=1,
        save_on_train_epoch_end=True,
    )
    module = build_module()
    global_batch = args.micro_batch * args.grad_accum * args.devices
    tokens = torch.randint(0, VOCAB, (args.save_at * global_batch, SEQ), generator=torch.Generator().manual_seed(7))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=args.micro_batch)
    # DeepSpeedStrategy wants device indices 0..n-1 (CUDA's); CPU devices have none unless given
    # (torch maps cpu:N to cpu)
    cpus = [torch.device("cpu", i) for i in range(args.devices)] if args.accelerator == "cpu" else None
    strategy = DeepSpeedStrategy(stage=args.stage, config=ds_config(args.stock, args.stage), parallel_devices=cpus)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.steps,
        accumulate_grad_batches=args.grad_accum,
        gradient_clip_val=1.0,
        use_distributed_sampler=True,
        callbacks=[saver],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=args.resume)
    assert isinstance(trainer.strategy, DeepSpeedStrategy)
    engine = trainer.strategy.deepspeed_engine
    per_step = {step: torch.stack(values).mean() for step, values in module.losses.items()}
    losses = {step: trainer.strategy.reduce(value, reduce_op="mean").item() for step, value in sorted(per_step.items())}
    params = gathered_parameters(engine.module)  # every rank: a collective at ZeRO-3
    if trainer.is_global_zero:
        report(losses, engine.optimizer, params, args.results)
    from ds_tensorshard.transports.torch_comm import close_process_group

    close_process_group()


if __name__ == "__main__":
    main()
