#!/usr/bin/env python
"""The ``zero_to_fp32.py`` that ds_tensorshard writes into its save dirs, where DeepSpeed writes a copy of its own.

Same command line as DeepSpeed's script::

    python zero_to_fp32.py SAVE_DIR OUTPUT_DIR [--max_shard_size 5GB] [--safe_serialization]
                           [-t TAG] [--exclude_frozen_parameters] [-d]

It imports ds_tensorshard, then runs DeepSpeed's own ``deepspeed.utils.zero_to_fp32``: a ds_tensorshard
tag is read by ds_tensorshard's converter (the weights of ``ds-tensorshard convert-checkpoint --to fp32``),
a stock ZeRO tag by DeepSpeed's code, and the files written are DeepSpeed's (``pytorch_model.bin``, shards,
index); with ``--safe_serialization`` a ds_tensorshard tag's safetensors files (same names and index) are written
one tensor at a time. DeepSpeed's ``zero_to_torch.py`` beside it imports this file as ``zero_to_fp32`` and finds the
functions it calls here.
"""

from __future__ import annotations

import argparse
from typing import Any

try:
    import ds_tensorshard  # noqa: F401  (routes ds_tensorshard tags to its converter)
except ImportError as err:
    raise SystemExit(
        f"this zero_to_fp32.py was written by ds_tensorshard and needs it installed ({err}); "
        "for a stock ZeRO tag, DeepSpeed's own `python -m deepspeed.utils.zero_to_fp32` also works"
    ) from None

from deepspeed.utils import zero_to_fp32 as _deepspeed

debug = 0  # set by zero_to_torch.py; handed to DeepSpeed's module on each call
OUTPUT_DTYPE_NAMES = getattr(_deepspeed, "OUTPUT_DTYPE_NAMES", {})


def _call(name: str, *args: Any, **kwargs: Any) -> Any:
    _deepspeed.debug = debug
    return getattr(_deepspeed, name)(*args, **kwargs)


def get_fp32_state_dict_from_zero_checkpoint(*args: Any, **kwargs: Any) -> Any:
    return _call("get_fp32_state_dict_from_zero_checkpoint", *args, **kwargs)


def convert_zero_checkpoint_to_fp32_state_dict(*args: Any, **kwargs: Any) -> Any:
    return _call("convert_zero_checkpoint_to_fp32_state_dict", *args, **kwargs)


def convert_zero_checkpoint_to_state_dict(*args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's dtype-choosing conversion (DeepSpeed releases that have it)."""
    return _call("convert_zero_checkpoint_to_state_dict", *args, **kwargs)


def load_state_dict_from_zero_checkpoint(*args: Any, **kwargs: Any) -> Any:
    return _call("load_state_dict_from_zero_checkpoint", *args, **kwargs)


def _streamed(args: argparse.Namespace) -> bool:
    """safetensors of a ds_tensorshard tag: written one tensor at a time (DeepSpeed's way builds each shard whole);
    False for any other tag, which DeepSpeed's code converts."""
    import os

    from ds_tensorshard.checkpoints.consolidate import write_safetensors
    from ds_tensorshard.checkpoints.convert import resolve
    from ds_tensorshard.checkpoints.fp32_reader import holds_tensorshard_rank_files, tensorshard_fp32_state_dict

    folder, _ = resolve(args.checkpoint_dir, args.tag)
    if not (os.path.isdir(folder) and holds_tensorshard_rank_files(folder)):
        return False
    lazy = tensorshard_fp32_state_dict(folder, args.exclude_frozen_parameters)
    write_safetensors(lazy, args.output_dir, args.max_shard_size)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="ZeRO-1/2 or ds_tensorshard checkpoint -> fp32 weights")
    parser.add_argument("checkpoint_dir", help="the save dir (holding 'latest' and the tag folders)")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin (or its shards and index)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB or 500MB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors files")
    parser.add_argument("-t", "--tag", default=None, help="tag folder to read (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="DeepSpeed's debug output")
    args = parser.parse_args(argv)
    global debug
    debug = int(args.debug)
    if args.safe_serialization and _streamed(args):
        return
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
