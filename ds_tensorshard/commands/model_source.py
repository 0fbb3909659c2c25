"""Where a command takes a model's tensor shapes from: ``--preset`` (with GPT size overrides),
``--model-config`` (a Hugging Face config.json) or ``--checkpoint`` (a save dir or tag folder)."""

from __future__ import annotations

import argparse

from ds_tensorshard.commands.models import PRESET_NAMES, Experts, Shapes

GPT_SIZE_KEYS = ("vocab", "seq", "width", "layers", "heads")


def add_model_arguments(parser: argparse.ArgumentParser, size_overrides: bool) -> None:
    """The mutually exclusive model sources, ``--tag``, and (``size_overrides``) ``--vocab/--seq/...``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="gpt2-small", choices=PRESET_NAMES, help="model shape (default gpt2-small)")
    source.add_argument(
        "--model-config", help="a Hugging Face config.json of a Llama-style model (Mixtral-style with experts)"
    )
    source.add_argument("--checkpoint", help="plan the tensors of this checkpoint (save dir or tag folder)")
    parser.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
    if size_overrides:
        for key in GPT_SIZE_KEYS:
            parser.add_argument(f"--{key}", type=int, help=f"override a GPT preset's {key}")


def model_shapes(args: argparse.Namespace) -> Shapes:
    """``(name, shape)`` of every tensor of the model the arguments name."""
    return model_description(args)[0]


def model_description(args: argparse.Namespace) -> tuple[Shapes, Experts | None]:
    """``(name, shape)`` of every tensor of the model the arguments name, and its experts (None: dense, or not
    known, as for a checkpoint)."""
    if args.checkpoint:
        from ds_tensorshard.checkpoints.convert import resolve
        from ds_tensorshard.checkpoints.sources import open_checkpoint

        source = open_checkpoint(resolve(args.checkpoint, args.tag)[0])
        return [(name, tuple(shape)) for name, shape in source.shapes.items()], None
    from ds_tensorshard.commands.models import hf_config_model, preset_experts, preset_shapes

    if args.model_config:
        return hf_config_model(args.model_config)
    overrides: dict[str, int] = {k: v for k in GPT_SIZE_KEYS if (v := getattr(args, k, None)) is not None}
    return preset_shapes(args.preset, **overrides), preset_experts(args.preset)
