"""One rank of a checkpoint run: TinyGPT at a fixed global batch, optionally loading and saving.

python checkpoint_worker.py OUT DTYPE MODE STAGE STEPS [--load DIR] [--save DIR --save-at K [K...]]
    [--die-during-save-at K] [--own-folder-at K] [--universal] [--split auto|never] [--optimizer NAME]
    [--moe EXPERTS:EP:K] [--persistence N] [--load-tag TAG] [--freeze-embedding] [--save-16bit DIR --gather-16bit 0|1]
    [+ OUT DTYPE ... [+ ...]]

Runs separated by ``+`` train one after another in the same process group (one launch for several runs at
one world size; a later run may load what an earlier one saved).

The global batch is 12 sequences per step (``CKPT_GLOBAL_BATCH``) whatever the world size (micro
batch 2, or 1 where the per-rank share is odd; GAS makes up the rest), and the same sequences make
up step s on every world size, so runs at different world sizes must agree. Rank 0 writes OUT: the
mean loss of each step run here and the final parameters (at stage 3 gathered as users gather them, with
``deepspeed.zero.GatheredParameters``), and after each save OUT.stepK: the parameters saved at step K. With
``--save-16bit``, each save is followed by ``engine.save_16bit_model(DIR/stepK)``, whose return value on
every rank rank 0 writes to OUT.16bit.stepK. With ``--moe``, the model is moe_worker.py's (a DeepSpeed
MoE layer; its param groups), each micro-batch's gating seeded by its first sequence's index so that
every world size routes the same tokens alike, and OUT (from every rank, ``OUT.rankR``) holds each
rank's parameters, keyed by global expert index.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
from collections.abc import Sequence

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.checkpoints.experts import global_names
from ds_tensorshard.errors import CheckpointError
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.emulated_accelerator import init_worker, model_device
from tests.helpers.optimizers import setup
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config, param_groups
from tests.workers.moe_worker import MoEModel
from tests.workers.moe_worker import param_groups as moe_param_groups

GLOBAL_BATCH = int(os.environ.get("CKPT_GLOBAL_BATCH", "12"))


def moe_model(spec: str) -> torch.nn.Module:
    experts, ep_size, k = map(int, spec.split(":"))
    return MoEModel(experts, ep_size, k)


def sample(step: int, index: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(100_000 * step + index))


def die_inside_torch_save() -> None:
    """From now on, torch.save writes half a file and the process is SIGKILLed: a crash mid-save."""
    real_save = torch.save

    def save_then_die(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        os.truncate(f, os.path.getsize(f) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_then_die


def command(*runs: Sequence[object]) -> list[str]:
    """This script's arguments for ``runs`` (each OUT, DTYPE, MODE, STAGE, STEPS, *OPTIONS) in one launch."""
    argv: list[str] = []
    for run in runs:
        argv += ["+"] * bool(argv) + [str(a) for a in run]
    return [__file__, *argv]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("dtype")
    parser.add_argument("mode")
    parser.add_argument("stage", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--save-at", type=int, nargs="+", default=[])
    parser.add_argument("--die-during-save-at", type=int, help="rank 1 is killed while writing this save")
    parser.add_argument(
        "--fail-save-at",
        type=int,
        help="rank 1 may write no file over 64 KiB (ulimit -f) during this save; every rank then "
        "prints the error and exits 3",
    )
    parser.add_argument(
        "--own-folder-at",
        type=int,
        help="in this save every rank but 0 writes to a folder of its own, DIR-rank<r> (a save folder not shared "
        "between hosts); every rank then prints the error and exits 3",
    )
    parser.add_argument("--universal", action="store_true")
    parser.add_argument("--split", default="auto", help="tensorshard.split_tensors")
    parser.add_argument("--optimizer", help="an inner optimizer of optimizers.py instead of AdamW")
    parser.add_argument("--moe", help="EXPERTS:EP:K: moe_worker.py's model with a DeepSpeed MoE layer")
    parser.add_argument(
        "--load-refused", action="store_true", help="--load must raise CheckpointError: rank 0 writes its message"
    )
    parser.add_argument("--load-tag", help="the tag --load loads (default: the folder's 'latest')")
    parser.add_argument("--persistence", type=int, help="zero_optimization.stage3_param_persistence_threshold")
    parser.add_argument("--freeze-embedding", action="store_true", help="the (tied) embedding does not train")
    parser.add_argument("--save-16bit", help="after each save, engine.save_16bit_model into DIR/stepK")
    parser.add_argument(
        "--gather-16bit", type=int, help="zero_optimization.stage3_gather_16bit_weights_on_model_save (0 or 1)"
    )
    return parser.parse_args(argv)


def config_of(args: argparse.Namespace, world: int) -> tuple[dict, int, int]:
    """The run's DeepSpeed config, its micro batch and gradient accumulation steps."""
    assert GLOBAL_BATCH % world == 0, (GLOBAL_BATCH, world)
    micro_batch = 2 if (GLOBAL_BATCH // world) % 2 == 0 else 1
    gas = GLOBAL_BATCH // (micro_batch * world)
    config = ds_config(args.dtype, args.mode, args.stage, world, args.split)
    config.update(
        gradient_accumulation_steps=gas, train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=micro_batch
    )
    if args.moe:  # one lr for every param group, as moe_worker.py
        config["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=1e-2)
    if args.universal:
        config["checkpoint"] = {"load_universal": True}
    if args.persistence is not None:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = args.persistence
    if args.gather_16bit is not None:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = bool(args.gather_16bit)
    return config, micro_batch, gas


def run(args: argparse.Namespace) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config, micro_batch, gas = config_of(args, world)
    torch.manual_seed(4321 if args.load else 1234)  # a loaded run must not depend on its own init
    with model_device():
        model = moe_model(args.moe) if args.moe else TinyGPT(vocab=VOCAB, seq=SEQ)
    if args.freeze_embedding:
        model.wte.weight.requires_grad_(False)
    client = setup(args.optimizer, model, config) if args.optimizer else None
    groups = [{"params": list(model.parameters())}] if args.optimizer == "adagrad" else param_groups(model)
    groups = moe_param_groups(model) if args.moe else groups
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config, optimizer=client)
    if args.load_refused:
        try:
            engine.load_checkpoint(args.load)
        except CheckpointError as err:
            if rank == 0:
                torch.save({"refused": str(err)}, args.out)
            return
        raise AssertionError(f"{args.load} was loaded")
    if args.load:
        path, client_state = engine.load_checkpoint(args.load, tag=args.load_tag)
        assert path is not None, f"nothing loaded from {args.load}"
        assert client_state.get("marker") == "kept", client_state
    losses = {}
    while engine.global_steps < args.steps:
        step = engine.global_steps
        total = torch.zeros((), device=engine.device)
        for micro in range(gas):
            first = (micro * world + rank) * micro_batch
            tokens = torch.stack([sample(step, first + i) for i in range(micro_batch)])
            if args.moe:
                torch.manual_seed(100_000 * step + first)  # the gate's random draws: this micro-batch's own
            loss = engine(tokens.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses[step] = total.item() / (gas * world)
        if args.save and engine.global_steps in args.save_at:
            if engine.global_steps == args.die_during_save_at and rank == 1:
                die_inside_torch_save()
            if engine.global_steps == args.fail_save_at and rank == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
            folder = args.save
            if engine.global_steps == args.own_folder_at and rank != 0:
                folder = f"{args.save}-rank{rank}"
            try:
                engine.save_checkpoint(folder, tag=f"step{engine.global_steps}", client_state={"marker": "kept"})
            except CheckpointError as err:
                print(f"SAVE FAILED {err}", flush=True)
                close_process_group()
                sys.exit(3)
            if args.save_16bit:
                save_16bit(engine, args, rank)
            if not args.moe:
                write_params(engine, f"{args.out}.step{engine.global_steps}", rank)
    if args.moe:
        named = global_names(engine.module, {p: n for n, p in engine.module.named_parameters()})
        params = {named[p]: p.detach().float().clone() for p in engine.module.parameters()}
        torch.save({"losses": losses, "params": params}, f"{args.out}.rank{rank}")
    else:
        write_params(engine, args.out, rank, losses)


def save_16bit(engine, args: argparse.Namespace, rank: int) -> None:
    """``engine.save_16bit_model`` into SAVE_16BIT/stepK; rank 0 writes every rank's return value."""
    step = engine.global_steps
    returned = engine.save_16bit_model(os.path.join(args.save_16bit, f"step{step}"))
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, returned)
    if rank == 0:
        torch.save(every, f"{args.out}.16bit.step{step}")


def write_params(engine, out: str, rank: int, losses: dict | None = None) -> None:
    """Rank 0 writes the parameters (gathered from their owners at stage 3, on every rank) and ``losses``."""
    stage3 = engine.zero_optimization_partition_weights()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage3):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)


def main() -> None:
    init_worker()
    get_accelerator().is_fp16_supported = lambda: True
    argv, runs = sys.argv[1:], []
    while "+" in argv:
        runs.append(argv[: argv.index("+")])
        argv = argv[argv.index("+") + 1 :]
    for run_args in [*runs, argv]:
        run(parse(run_args))
    close_process_group()


if __name__ == "__main__":
    main()
