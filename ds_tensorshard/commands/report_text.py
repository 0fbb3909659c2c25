"""``ds-tensorshard report`` as text: the machine, the build locks, the config check and the plans, one line each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RULE = "-" * 60


def format_text(report: Mapping[str, Any]) -> list[str]:
    """The report (``commands.report.gather``'s dict) as the lines the command prints."""
    lines = ["ds_tensorshard report", RULE, *_versions(report["versions"]), *_mpi(report["mpi"])]
    lines += _machine(report)
    lines += _build_locks(report["build_locks"])
    if "config" in report:
        lines += _config(report["config"])
    if report.get("plans"):
        from ds_tensorshard.commands.plan_report import format_report

        lines.append(RULE)
        for plan in report["plans"]:
            lines += format_report(plan)
    stale = [lock for lock in report["build_locks"] if lock["stale"]]
    if stale:
        lines += [RULE, f"{len(stale)} stale build lock(s): remove them before the next run"]
    return lines


def _versions(v: Mapping[str, Any]) -> list[str]:
    return [
        f"python           {v['python']}",
        f"torch            {v['torch']}" + (f" (CUDA {v['torch_cuda']})" if v["torch_cuda"] else " (CPU build)"),
        f"deepspeed        {v['deepspeed']}"
        + (f"  NOT SUPPORTED: {v['deepspeed_unsupported']}" if v["deepspeed_unsupported"] else "  (supported)"),
        f"ds_tensorshard   {v['ds_tensorshard']}",
    ]


def _mpi(mpi: Mapping[str, Any]) -> list[str]:
    if "error" in mpi:
        return [f"mpi4py           {mpi.get('mpi4py', '-')}: {mpi['error']}"]
    aware = {
        True: "yes",
        False: "no (CUDA tensors are staged through pinned host memory)",
        None: "unknown (neither mpi4py nor the library tells): treated as no",
    }[mpi.get("cuda_aware")]
    return [
        f"mpi4py           {mpi['mpi4py']}",
        f"MPI library      {mpi['library']} (MPI {mpi['standard']})",
        f"CUDA-aware MPI   {aware}",
    ]


def _machine(report: Mapping[str, Any]) -> list[str]:
    """Launchers, the accelerator, the transports and FusedAdam."""
    acc, fa = report["accelerator"], report["fused_adam"]
    lines = ["launchers        " + ", ".join(f"{k}: {p or 'not found'}" for k, p in report["launchers"].items())]
    lines.append(
        f"accelerator      {acc['name']} x{acc['device_count']}, communication backend "
        f"{acc['communication_backend']}"
        + (f" (DS_ACCELERATOR={acc['DS_ACCELERATOR']})" if acc["DS_ACCELERATOR"] else "")
    )
    for name, state in report["transports"].items():
        lines.append(f"comm_backend {name!r:<7} {state}")
    built = (
        "prebuilt into DeepSpeed"
        if fa["prebuilt"]
        else f"JIT-built in {fa['folder']}"
        if fa["jit_built"]
        else f"not built yet: the first run JIT-builds it into {fa['folder']} (about a minute on 2 cores"
        + (")" if fa["ninja"] else "; needs ninja: pip install ninja)")
    )
    lines.append(f"FusedAdam        {built}")
    return lines


def _build_locks(locks: list[Mapping[str, Any]]) -> list[str]:
    lines = []
    for lock in locks:
        lines.append(
            f"build lock       {lock['path']}: {'STALE, ' if lock['stale'] else ''}{lock['why']}"
            + (
                f"; every later load of {lock['op']} waits on it forever: remove it with `{lock['fix']}`"
                if lock["stale"]
                else ""
            )
        )
    return lines or ["build locks      none"]


def _config(cfg: Mapping[str, Any]) -> list[str]:
    lines = [
        RULE,
        f"config           {cfg['path']}: {'ACCEPTED' if cfg['accepted'] else 'REFUSED'}",
        f"  deepspeed      {cfg['deepspeed']}",
    ]
    if cfg["tensorshard"] is not None:
        lines.append(f"  ds_tensorshard {cfg['tensorshard']}")
    if cfg["auto_keys"]:
        lines.append('  "auto" values  ' + ", ".join(cfg["auto_keys"]) + " (filled in by HF Trainer / Accelerate)")
    if cfg.get("note"):
        lines.append(f"  note           {cfg['note']}")
    if cfg.get("warning"):
        lines.append(f"  warning        {cfg['warning']}")
    return lines
