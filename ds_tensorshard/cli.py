"""``ds-tensorshard`` command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

from .plan import OwnershipPlan, plan_ownership


def _model_tensors(args: argparse.Namespace) -> list[tuple[str, int]]:
    if args.checkpoint:
        from .checkpoint_sources import open_checkpoint
        from .convert import resolve
        source = open_checkpoint(resolve(args.checkpoint, args.tag)[0])
        return [(name, int(math.prod(shape))) for name, shape in source.shapes.items()]
    from .examples.gpt import PRESETS, build
    overrides = {k: getattr(args, k) for k in PRESETS["demo"] if getattr(args, k) is not None}
    model = build(args.preset, device="meta", **overrides)
    return [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]


def _plan_report(plan: OwnershipPlan, tensors: list[tuple[str, int]]) -> dict:
    largest = max(tensors, key=lambda t: t[1])
    return {"world_size": plan.world_size, "tensors": len(tensors), "total_numel": plan.total_numel,
            "numel_per_rank": list(plan.numel_per_rank), "largest_tensor": {"name": largest[0], "numel": largest[1]},
            "imbalance": round(plan.imbalance, 6), "imbalance_bound": round(plan.imbalance_bound, 6)}


def cmd_plan(args: argparse.Namespace) -> int:
    tensors = _model_tensors(args)
    reports = [_plan_report(plan_ownership(tensors, n), tensors) for n in args.world_size]
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    for r in reports:
        print(f"world size {r['world_size']}: {r['tensors']} tensors, {r['total_numel']:,} elements; "
              f"largest {r['largest_tensor']['name']} ({r['largest_tensor']['numel']:,}); "
              f"imbalance (fullest / ideal) {r['imbalance']:.4f}, best possible {r['imbalance_bound']:.4f}")
        for rank, numel in enumerate(r["numel_per_rank"]):
            print(f"  rank {rank}: {numel:,}")
    return 0


def cmd_migrate_config(args: argparse.Namespace) -> int:
    from .migrate import migrate_config
    with open(args.input) as f:
        stock = json.load(f)
    config, report = migrate_config(stock)
    with open(args.output, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    for line in report:
        print(line)
    print(f"wrote {args.output} (passes ds_tensorshard validation)")
    return 0


def cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    from .convert import convert
    written = convert(args.src, args.dst, args.to, tag=args.tag, world_size=args.world_size, stage=args.stage,
                      universal=args.universal)
    print(f"wrote {written}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-tensorshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="ownership plan of a GPT-style model or a checkpoint at given world sizes")
    plan.add_argument("--checkpoint", help="plan the tensors of this checkpoint (save dir or tag folder)")
    plan.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
    plan.add_argument("--preset", default="gpt2-small", choices=["demo", "gpt2-small"],
                      help="model shape (default gpt2-small)")
    for key in ("vocab", "seq", "width", "layers", "heads"):
        plan.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    plan.add_argument("--world-size", type=int, nargs="+", required=True, help="one or more world sizes")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=cmd_plan)

    migrate = sub.add_parser("migrate-config", help="rewrite a stock ZeRO-1/2 ds_config for ds_tensorshard")
    migrate.add_argument("input", help="stock DeepSpeed config JSON")
    migrate.add_argument("-o", "--output", required=True, help="where to write the new config")
    migrate.set_defaults(func=cmd_migrate_config)

    conv = sub.add_parser("convert-checkpoint", help="convert between stock ZeRO, ds_tensorshard and fp32 weights")
    conv.add_argument("src", help="checkpoint save dir (tag from 'latest') or tag folder")
    conv.add_argument("dst", help="save dir to write (--to tensorshard|zero) or .pt file (--to fp32)")
    conv.add_argument("--to", required=True, choices=["tensorshard", "fp32", "zero"])
    conv.add_argument("--tag", help="tag to convert (default: the 'latest' file)")
    conv.add_argument("--world-size", type=int, default=1, help="ranks the written files are laid out for")
    conv.add_argument("--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage recorded with --to zero")
    conv.add_argument("--universal", action="store_true", help="the source is a DeepSpeed universal checkpoint")
    conv.set_defaults(func=cmd_convert_checkpoint)

    from .bench import add_arguments, run
    bench = sub.add_parser("bench", help="ds_tensorshard vs stock ZeRO-0/1/2 and DDP+ZeroRedundancyOptimizer")
    add_arguments(bench)
    bench.set_defaults(func=lambda args: run(args) and 0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .checkpoint_files import CheckpointError
    from .config import TensorShardConfigError
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, TensorShardConfigError, OSError) as err:
        print(f"ds-tensorshard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
