"""``ds-tensorshard report``: what this machine offers ds_tensorshard, and whether a config would be accepted.

In the spirit of DeepSpeed's ``ds_report``: versions, MPI and the transports that can run here
(:mod:`.machine`), whether FusedAdam is built and stale JIT build locks (:mod:`.extensions`); given ``--config``,
DeepSpeed's own parse of the config and then ds_tensorshard's checks (:mod:`.config_check`, with the messages
``deepspeed.initialize`` gives); given ``--world-size``, the ownership plan of a model at those world sizes (as
``ds-tensorshard plan``). Printed as text by :mod:`.report_text`, or as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ds_tensorshard.commands.config_check import check_config, load_config, without_auto
from ds_tensorshard.commands.extensions import build_locks, fused_adam
from ds_tensorshard.commands.machine import accelerator, launchers, mpi_info, transports, versions
from ds_tensorshard.commands.report_text import format_text

if TYPE_CHECKING:
    from ds_tensorshard.datapath.plan import SplitMode


def gather(
    config_path: str | None = None,
    world_sizes: list[int] | None = None,
    shapes: Any = None,
    split: SplitMode = "auto",
    bucket: int | None = None,
) -> dict[str, Any]:
    """Everything the report shows, as one JSON-able dict."""
    report: dict[str, Any] = {
        "versions": versions(),
        "mpi": mpi_info(),
        "launchers": launchers(),
        "accelerator": accelerator(),
        "fused_adam": fused_adam(),
        "build_locks": build_locks(),
    }
    report["transports"] = transports(report["mpi"], report["accelerator"])
    config = None
    if config_path is not None:
        config = load_config(config_path)
        sizes: list[int | None] = list(world_sizes) if world_sizes else [None]
        checks = [check_config(config, n) for n in sizes]
        report["config"] = {"path": config_path, **next((c for c in checks if not c["accepted"]), checks[0])}
        cfg = report["config"]
        if cfg.get("comm_backend") == "mpi" and not report["transports"]["mpi"].startswith("yes"):
            cfg["warning"] = "comm_backend 'mpi' cannot run here: " + report["transports"]["mpi"]
    if world_sizes and shapes is not None:
        from ds_tensorshard.commands.plan_report import plan_report
        from ds_tensorshard.config.schema import TensorShardConfig
        from ds_tensorshard.datapath.defaults import DEFAULT_BUCKET_NUMEL, requested_bucket_numel

        if config is not None and report["config"]["accepted"] and report["config"].get("enabled"):
            split = report["config"]["split_tensors"]
            bucket = (
                bucket
                or requested_bucket_numel(
                    TensorShardConfig(**without_auto(config.get("tensorshard", {}))), without_auto(config)
                )[0]
            )
        report["plans"] = [plan_report(shapes, n, bucket or DEFAULT_BUCKET_NUMEL, split) for n in world_sizes]
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_tensorshard.commands.model_source import add_model_arguments

    parser.add_argument("--config", help="a ds_config JSON: would deepspeed.initialize accept it?")
    parser.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        help="plan the model at these world sizes (and check the config's batch sizes at them)",
    )
    add_model_arguments(parser, size_overrides=False)
    parser.add_argument(
        "--split-tensors", choices=["auto", "never"], default="auto", help="without an enabled --config (default auto)"
    )
    parser.add_argument("--bucket-numel", type=int, help="elements per bucket (default: the config's, else 4,000,000)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    """The ``report`` subcommand; exit status 1 when the config is refused or a build lock is stale."""
    shapes = None
    if args.world_size:
        from ds_tensorshard.commands.model_source import model_shapes

        shapes = model_shapes(args)
    report = gather(args.config, args.world_size, shapes, args.split_tensors, args.bucket_numel)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(format_text(report)))
    refused = "config" in report and not report["config"]["accepted"]
    return 1 if refused or any(lock["stale"] for lock in report["build_locks"]) else 0
