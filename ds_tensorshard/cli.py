"""``ds-tensorshard`` command line."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .plan import OwnershipPlan, plan_ownership


def _model_tensors(args: argparse.Namespace) -> list[tuple[str, int]]:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-tensorshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="ownership plan of a GPT-style model at given world sizes")
    plan.add_argument("--preset", default="gpt2-small", choices=["demo", "gpt2-small"],
                      help="model shape (default gpt2-small)")
    for key in ("vocab", "seq", "width", "layers", "heads"):
        plan.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    plan.add_argument("--world-size", type=int, nargs="+", required=True, help="one or more world sizes")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
