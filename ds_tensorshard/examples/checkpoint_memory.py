"""Peak RSS of saving and loading a ds_tensorshard checkpoint, per rank.

Two runs of this module (``--phase save`` then ``--phase load``) with the same ranks; each trains
one step first, so that training's own peak is the baseline, then saves or loads and reports how
far each rank's peak RSS rose above that baseline::

    deepspeed --num_gpus 2 --module ds_tensorshard.examples.checkpoint_memory --phase save --dir /tmp/ck
    deepspeed --num_gpus 2 --module ds_tensorshard.examples.checkpoint_memory --phase load --dir /tmp/ck

``--stage 3``: ZeRO stage 3 (each parameter kept by its owner only, released between uses).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource

import deepspeed
import torch
from deepspeed import comm as dist

import ds_tensorshard  # noqa: F401
from ds_tensorshard.commands.models import PRESETS, build, synthetic_batch
from ds_tensorshard.datapath.shapes import numel_of
from ds_tensorshard.transports.torch_comm import close_process_group


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--dir", required=True, help="checkpoint save dir")
    parser.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence in the training step")
    for key in ("layers", "width", "vocab"):
        parser.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="the ZeRO stage")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": args.stage},
        "tensorshard": {"enabled": True, "bucket_numel": 20_000_000},
    }
    torch.manual_seed(0)
    overrides = {k: getattr(args, k) for k in ("layers", "width", "vocab") if getattr(args, k) is not None}
    model = build(args.preset, **overrides)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    shape = {**PRESETS[args.preset], **overrides}
    tokens = synthetic_batch(1, min(args.seq, shape["seq"]), shape["vocab"], torch.Generator().manual_seed(1))
    engine.backward(engine(tokens))
    engine.step()
    gc.collect()
    baseline = peak_rss_mib()
    if args.phase == "save":
        engine.save_checkpoint(args.dir, tag="memory")
    else:
        engine.load_checkpoint(args.dir)
    peak = peak_rss_mib()
    rank = dist.get_rank()
    owned = optimizer.plan.numel_per_rank[rank]
    largest = max(numel_of(p) for p in optimizer.params)
    row = {
        "phase": args.phase,
        "rank": rank,
        "peak_training_mib": round(baseline, 1),
        "peak_after_mib": round(peak, 1),
        "rise_mib": round(peak - baseline, 1),
        "own_state_mib": round(owned * 12 / 2**20, 1),
        "largest_tensor_state_mib": round(largest * 12 / 2**20, 1),
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            print("MEMORY " + json.dumps(r), flush=True)
    close_process_group()


if __name__ == "__main__":
    main()
