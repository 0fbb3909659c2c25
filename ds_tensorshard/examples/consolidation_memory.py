"""Peak RSS of consolidating a stock ZeRO-3 checkpoint into one state dict: DeepSpeed's zero_to_fp32 against
``ds-tensorshard convert-checkpoint --to fp32``, side by side, each in a fresh process under ``/usr/bin/time -v``::

    python -m ds_tensorshard.examples.consolidation_memory --dir /tmp/consolidate            # GPT, 1.11B parameters
    python -m ds_tensorshard.examples.consolidation_memory --dir /tmp/c --width 128 --layers 2 --vocab 256 --heads 4

First (``--dir`` empty) it writes the checkpoint: a GPT of :mod:`ds_tensorshard.commands.models` (fp32, tied head)
in stock ZeRO-3's layout for 2 ranks, fp32 masters in flat partitions and each rank's module file, through
``convert-checkpoint``'s ZeRO-3 writer (whose files equal stock ZeRO-3's own save, tests/multiprocess/
test_checkpoint.py); it holds no optimizer moments (neither tool reads them: DeepSpeed's maps the files and drops
them unread). Then each conversion runs alone and its peak RSS is printed as a JSON line per tool: on that folder,
and on the ds_tensorshard save that ``--to tensorshard`` makes of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import torch

from ds_tensorshard.checkpoints.files import write_text_atomic
from ds_tensorshard.checkpoints.sources import CheckpointSource, TensorState
from ds_tensorshard.checkpoints.stock_tools import copy_deepspeed_recovery_scripts
from ds_tensorshard.checkpoints.zero3_writer import to_zero3
from ds_tensorshard.commands.models import build

TAG = "step0"


class ModelSource(CheckpointSource):
    """A model's parameters as a checkpoint source: one param group, fp32 masters, no optimizer state yet."""

    kind = "model"

    def __init__(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())  # a tied parameter once, under its first name
        seen = {id(p): n for n, p in params.items()}
        every = dict(model.named_parameters(remove_duplicate=False))
        self.folder, self.world_size = "<model>", 1
        self.group_names = [list(params)]
        self.shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.params, self.param_groups, self.scaler = params, [{"lr": 1e-4, "weight_decay": 0.0}], None
        module = {n: torch.empty(0) if n in every else v for n, v in model.state_dict().items()}
        self.model_states = {
            "module": module,
            "buffer_names": [n for n, _ in model.named_buffers()],
            "param_shapes": [{n: torch.Size(s) for n, s in self.shapes.items()}],
            "frozen_param_shapes": {},
            "shared_params": {n: seen[id(p)] for n, p in every.items() if seen[id(p)] != n},
            "dp_world_size": 1,
            "mp_world_size": 1,
            "global_steps": 0,
            "skipped_steps": 0,
            "ds_config": {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1},
            "ds_version": "0.19.8",
        }

    def tensor(self, name: str) -> TensorState:
        return TensorState(self.params[name].detach(), {})


def make(save_dir: str, overrides: dict) -> int:
    """Write the stock ZeRO-3 checkpoint (2 ranks) of a freshly built GPT; returns its parameters."""
    torch.manual_seed(0)
    with torch.no_grad():
        model = build("gpt2-small", **overrides)
    source = ModelSource(model)
    to_zero3(source, save_dir, TAG, world_size=2)
    copy_deepspeed_recovery_scripts(save_dir)
    write_text_atomic(os.path.join(save_dir, "latest"), TAG)
    return sum(p.numel() for p in source.params.values())


def peak_rss_mib(command: list[str]) -> float:
    """Run ``command`` in a fresh process under ``/usr/bin/time -v``; its peak RSS (MiB)."""
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{proc.stderr[-3000:]}")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    assert found, proc.stderr[-2000:]
    return int(found.group(1)) / 1024


def conversions(args_dir: str) -> dict[str, list[str]]:
    """Each tool's command, by name, in the order they run (the third writes the ds_tensorshard save the last two
    read). DeepSpeed's scripts run with their defaults: ``pytorch_model.bin`` shards of 5GB."""
    zero3, ts, out = (os.path.join(args_dir, d) for d in ("zero3", "ts", "out"))
    cli = [sys.executable, "-m", "ds_tensorshard.commands.cli", "convert-checkpoint"]
    return {
        "stock ZeRO-3: deepspeed zero_to_fp32.py": [sys.executable, f"{zero3}/zero_to_fp32.py", zero3, f"{out}/ds"],
        "stock ZeRO-3: ds-tensorshard --to fp32 --safetensors": [
            *cli,
            zero3,
            f"{out}/st",
            "--to",
            "fp32",
            "--safetensors",
        ],
        "stock ZeRO-3: ds-tensorshard --to fp32 --safetensors --max-shard-size 2GB": [
            *cli,
            zero3,
            f"{out}/st2",
            "--to",
            "fp32",
            "--safetensors",
            "--max-shard-size",
            "2GB",
        ],
        "stock ZeRO-3: ds-tensorshard --to fp32 (one .pt file)": [*cli, zero3, f"{out}/weights.pt", "--to", "fp32"],
        "stock ZeRO-3: ds-tensorshard --to tensorshard --world-size 2": [
            *cli,
            zero3,
            ts,
            "--to",
            "tensorshard",
            "--world-size",
            "2",
        ],
        "ds_tensorshard: ds-tensorshard --to fp32 --safetensors": [
            *cli,
            ts,
            f"{out}/tst",
            "--to",
            "fp32",
            "--safetensors",
        ],
        "ds_tensorshard: its zero_to_fp32.py --safe_serialization (streamed)": [
            sys.executable,
            f"{ts}/zero_to_fp32.py",
            ts,
            f"{out}/tsst",
            "--safe_serialization",
        ],
        "ds_tensorshard: its zero_to_fp32.py (DeepSpeed's functions through ds_tensorshard)": [
            sys.executable,
            f"{ts}/zero_to_fp32.py",
            ts,
            f"{out}/tsds",
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where the checkpoint goes (made if absent) and the outputs")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    save_dir, out = os.path.join(args.dir, "zero3"), os.path.join(args.dir, "out")
    if not os.path.isfile(os.path.join(save_dir, "latest")):
        numel = make(save_dir, {"width": args.width, "layers": args.layers, "vocab": args.vocab, "heads": args.heads})
        print(json.dumps({"made": save_dir, "parameters": numel}), flush=True)
    shutil.rmtree(os.path.join(args.dir, "ts"), ignore_errors=True)
    for name, command in conversions(args.dir).items():
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        print(json.dumps({"tool": name, "peak_rss_mib": round(peak_rss_mib(command), 1)}), flush=True)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
