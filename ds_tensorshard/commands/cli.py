"""``ds-tensorshard`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from ds_tensorshard.commands.model_source import add_model_arguments, model_description


def cmd_plan(args: argparse.Namespace) -> int:
    from ds_tensorshard.commands.plan_report import format_moe_report, format_report, moe_plan_report, plan_report
    from ds_tensorshard.datapath.cost_model import DEFAULT_NETWORK, parse_network
    from ds_tensorshard.datapath.defaults import DEFAULT_BUCKET_NUMEL
    from ds_tensorshard.errors import PlanError

    shapes, experts = model_description(args)
    network = parse_network(args.network) if args.network else DEFAULT_NETWORK
    bucket_numel = args.bucket_numel or DEFAULT_BUCKET_NUMEL
    options = (bucket_numel, args.split_tensors, args.optimizer, network, args.element_bytes)
    if args.stage == 3:
        return _plan_stage3(args, shapes, network)
    if args.expert_parallel is None:
        reports = [plan_report(shapes, n, *options) for n in args.world_size]
    elif experts is None:
        raise PlanError(
            f"--expert-parallel {args.expert_parallel}: the model has no experts (a --model-config with "
            "'num_local_experts' and 'num_experts_per_tok' has)"
        )
    else:
        reports = [moe_plan_report(shapes, experts, n, args.expert_parallel, *options) for n in args.world_size]
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    for report in reports:
        print("\n".join(format_report(report) if args.expert_parallel is None else format_moe_report(report)))
    return 0


def _plan_stage3(args: argparse.Namespace, shapes, network) -> int:
    """``plan --stage 3``: memory per rank and communication per step against stock ZeRO-3."""
    from ds_tensorshard.commands.plan_stage3 import format_stage3_report, stage3_plan_report
    from ds_tensorshard.errors import PlanError

    if args.expert_parallel is not None or args.optimizer != "adam":
        raise PlanError("--stage 3 plans data parallelism with Adam: leave out --expert-parallel and --optimizer")
    reports = [stage3_plan_report(shapes, n, args.split_tensors, network, args.element_bytes) for n in args.world_size]
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        for report in reports:
            print("\n".join(format_stage3_report(report)))
    return 0


def cmd_migrate_config(args: argparse.Namespace) -> int:
    from ds_tensorshard.commands.migrate import migrate_config

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
    from ds_tensorshard.checkpoints.convert import WeightsOptions, convert
    from ds_tensorshard.commands.progress import terminal_callback

    written = convert(
        args.src,
        args.dst,
        args.to,
        tag=args.tag,
        world_size=args.world_size,
        stage=args.stage,
        universal=args.universal,
        progress=terminal_callback,  # a bar per conversion on a terminal, nothing in a log
        weights=WeightsOptions(args.dtype, args.safetensors, args.max_shard_size),
    )
    print(f"wrote {written}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `ds-tensorshard` parser: one subcommand per job."""
    parser = argparse.ArgumentParser(prog="ds-tensorshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan(sub)

    migrate = sub.add_parser("migrate-config", help="rewrite a stock ZeRO-1/2/3 ds_config for ds_tensorshard")
    migrate.add_argument("input", help="stock DeepSpeed config JSON")
    migrate.add_argument("-o", "--output", required=True, help="where to write the new config")
    migrate.set_defaults(func=cmd_migrate_config)

    conv = sub.add_parser("convert-checkpoint", help="convert between stock ZeRO, ds_tensorshard and fp32 weights")
    conv.add_argument("src", help="checkpoint save dir (tag from 'latest') or tag folder")
    conv.add_argument("dst", help="save dir to write (--to tensorshard|zero) or .pt file (--to fp32)")
    conv.add_argument("--to", required=True, choices=["tensorshard", "fp32", "zero"])
    conv.add_argument("--tag", help="tag to convert (default: the 'latest' file)")
    conv.add_argument("--world-size", type=int, default=1, help="ranks the written files are laid out for")
    conv.add_argument(
        "--stage", type=int, default=2, choices=[1, 2, 3], help="the stock ZeRO stage --to zero writes (its layout)"
    )
    conv.add_argument("--universal", action="store_true", help="the source is a DeepSpeed universal checkpoint")
    conv.add_argument(
        "--safetensors",
        action="store_true",
        help="--to fp32: write DST/model.safetensors (or shards), streamed one tensor at a time",
    )
    conv.add_argument(
        "--max-shard-size", help="--to fp32: shards of at most this size into folder DST (e.g. 5GB), with an index"
    )
    conv.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="--to fp32: the floating tensors' dtype"
    )
    conv.set_defaults(func=cmd_convert_checkpoint)

    from ds_tensorshard.bench import add_arguments, run

    bench = sub.add_parser("bench", help="ds_tensorshard vs stock ZeRO-0/1/2 and DDP+ZeroRedundancyOptimizer")
    add_arguments(bench)
    bench.set_defaults(func=lambda args: run(args) and 0)

    from ds_tensorshard.commands import report as report_command

    report = sub.add_parser(
        "report",
        help="versions, MPI library, transports, FusedAdam, stale build locks; "
        "whether --config would be accepted; the plan at --world-size",
    )
    report_command.add_arguments(report)
    report.set_defaults(func=report_command.run)
    return parser


def _add_plan(sub: argparse._SubParsersAction) -> None:
    """The ``plan`` command and its arguments."""
    plan = sub.add_parser("plan", help="ownership plan, buckets and wire volume of a model at given world sizes")
    add_model_arguments(plan, size_overrides=True)
    plan.add_argument("--world-size", type=int, nargs="+", required=True, help="one or more world sizes")
    plan.add_argument(
        "--split-tensors",
        choices=["auto", "never"],
        default="auto",
        help="tensorshard.split_tensors (default auto); 'never' is always reported beside it",
    )
    plan.add_argument(
        "--bucket-numel",
        type=int,
        help="elements per bucket of the windows, stripes and stock rows (default 4,000,000); the default layout's "
        "own size and stock's own defaults are reported beside them",
    )
    plan.add_argument(
        "--optimizer",
        choices=["adam", "muon"],
        default="adam",
        help="muon: the layers' matrices stay whole and their Newton-Schulz work is balanced and "
        "reported next to stock ZeRO's",
    )
    plan.add_argument(
        "--network",
        metavar="ALPHA_US,BUS_GBPS[,INTRA_NODE_RANKS,INTRA_GBPS]",
        help="latency per hop and bus bandwidths of the predicted communication time (default 9.6,400,8,450: "
        "8-GPU H100 nodes over 8 x 400 Gb/s InfiniBand; see docs/performance.md)",
    )
    plan.add_argument(
        "--element-bytes", type=int, choices=[2, 4], default=2, help="bytes per gradient element on the wire (bf16: 2)"
    )
    plan.add_argument(
        "--expert-parallel",
        type=int,
        metavar="EP",
        help="expert-parallel size of a mixture of experts (--model-config with 'num_local_experts'): the "
        "tensors outside the experts planned over all ranks, each EP rank's experts over its world / EP "
        "expert-data-parallel ranks",
    )
    plan.add_argument(
        "--stage",
        type=int,
        choices=[2, 3],
        default=2,
        help="3: what each rank keeps and the gathers, reductions and their predicted time per step against "
        "stock ZeRO-3 at its defaults",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=cmd_plan)


def _logs_to_stderr() -> None:
    """DeepSpeed logs to stdout; the commands print their results there (``--json`` for scripts)."""
    from deepspeed.utils import logger

    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    _logs_to_stderr()
    from ds_tensorshard.errors import CheckpointError, TensorShardConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, TensorShardConfigError, OSError, ValueError) as err:
        print(f"ds-tensorshard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
