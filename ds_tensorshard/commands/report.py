"""``ds-tensorshard report``: what this machine offers ds_tensorshard, and whether a config would be accepted.

In the spirit of DeepSpeed's ``ds_report``: versions (Python, torch, DeepSpeed, mpi4py, the MPI library
and whether it is CUDA-aware), the transports that can run here, whether FusedAdam is built, the
accelerator, stale JIT build locks; given ``--config``, DeepSpeed's own parse of the config and then
ds_tensorshard's checks (the ones ``deepspeed.initialize`` runs, with the same messages); given
``--world-size``, the ownership plan of a model at those world sizes (as ``ds-tensorshard plan``).
The MPI library is probed in a child process with a deadline, so a broken MPI cannot hang the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_tensorshard.datapath.plan import SplitMode

MPI_PROBE_TIMEOUT_S = 60
STALE_LOCK_AGE_S = 1800  # no JIT build of a DeepSpeed op takes this long, even on 2 cores
LOCK_GRACE_S = 120  # a build's lock exists for a moment before its compiler starts
FUSED_ADAM = "fused_adam"
_MPI_PROBE = """
import json
out = {}
try:
    import mpi4py
    out["mpi4py"] = mpi4py.__version__
    from mpi4py import MPI
    out["library_text"] = MPI.Get_library_version().replace("\\x00", "").strip()
    out["library"] = " ".join(out["library_text"].splitlines()[0].split())
    out["standard"] = "%d.%d" % MPI.Get_version()
    query = getattr(MPI, "Query_cuda_support", None)
    out["cuda_aware"] = bool(query()) if query is not None else None
except ImportError as err:
    out["error"] = "not installed (%s)" % err
except Exception as err:
    out["error"] = "%s: %s" % (type(err).__name__, err)
print("MPIPROBE " + json.dumps(out))
"""


# -- pieces of the report -----------------------------------------------------------------------
def versions() -> dict[str, Any]:
    """Python, torch, DeepSpeed (and whether ds_tensorshard supports it), ds_tensorshard."""
    import deepspeed
    import torch

    from ds_tensorshard import __version__
    from ds_tensorshard.errors import UnsupportedDeepSpeedVersion, UnsupportedTorchVersion
    from ds_tensorshard.versions import check_deepspeed_version, check_torch_version

    try:
        check_deepspeed_version(deepspeed.__version__)
        supported = None
    except UnsupportedDeepSpeedVersion as err:
        supported = str(err)
    try:
        check_torch_version(torch.__version__)
        torch_supported = None
    except UnsupportedTorchVersion as err:
        torch_supported = str(err)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_unsupported": torch_supported,
        "torch_cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "deepspeed_unsupported": supported,
        "ds_tensorshard": __version__,
    }


def mpi_info(timeout_s: float = MPI_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """mpi4py's version, the MPI library's version string and CUDA-awareness, probed in a child process."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _MPI_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"importing mpi4py's MPI did not finish within {timeout_s:.0f} s (MPI_Init hangs here)"}
    for line in proc.stdout.splitlines():
        if line.startswith("MPIPROBE "):
            found = json.loads(line[len("MPIPROBE ") :])
            if found.get("cuda_aware") is None and "library_text" in found:
                found["cuda_aware"] = _cuda_from_build(found.pop("library_text"))
            found.pop("library_text", None)
            return found
    return {"error": f"the MPI probe exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}"}


def _cuda_from_build(library_text: str) -> bool | None:
    """CUDA support from how the library was built, where mpi4py cannot query it: MPICH prints its configure
    line in its version text; Open MPI's ``ompi_info`` reports ``opal_built_with_cuda_support``."""
    if library_text.startswith("MPICH"):
        return "cuda" in library_text.lower()
    if library_text.startswith("Open MPI") and shutil.which("ompi_info"):
        try:
            info = subprocess.run(
                ["ompi_info", "--parsable", "--all"], capture_output=True, text=True, timeout=MPI_PROBE_TIMEOUT_S
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in info.splitlines():
            if "built_with_cuda_support:value:" in line:
                return line.rsplit(":", 1)[1].strip() == "true"
    return None


def launchers() -> dict[str, str | None]:
    """MPI and DeepSpeed launchers on PATH (``ompi_info`` is what ``deepspeed --launcher openmpi`` looks for)."""
    return {name: shutil.which(name) for name in ("mpiexec", "mpirun", "ompi_info", "deepspeed", "srun")}


def accelerator() -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return {
        "name": acc.device_name(),
        "communication_backend": acc.communication_backend_name(),
        "device_count": acc.device_count(),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR"),
    }


def transports(mpi: Mapping[str, Any], accel: Mapping[str, Any]) -> dict[str, str]:
    """Which ``tensorshard.comm_backend`` values can run here, and why not where one cannot."""
    import torch.distributed as tdist

    found = {}
    if not tdist.is_available():
        found["torch"] = "no: this torch was built without torch.distributed"
    else:
        backend = accel["communication_backend"]
        available = {
            "gloo": tdist.is_gloo_available(),
            "nccl": tdist.is_nccl_available(),
            "mpi": tdist.is_mpi_available(),
        }.get(backend, True)
        found["torch"] = f"yes ({backend})" if available else f"no: torch has no {backend} backend"
    if "error" in mpi:
        found["mpi"] = (
            f"no: mpi4py {mpi['error']} (pip install 'ds_tensorshard[mpi]', see docs/cluster.md, 'Installing an MPI')"
        )
    else:
        launcher = next((p for p in (shutil.which("mpiexec"), shutil.which("mpirun")) if p), None)
        found["mpi"] = "yes, " + (
            f"launch with {launcher}"
            if launcher
            else "but no mpiexec/mpirun on PATH: ranks must come from an MPI launcher"
        )
    return found


def extension_roots() -> list[str]:
    """Where torch keeps JIT-built extensions: ``TORCH_EXTENSIONS_DIR`` if set, and torch's default folder."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    roots = []
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        roots.append(os.environ["TORCH_EXTENSIONS_DIR"])
    tag = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    if torch.version.hip is not None:
        tag = "rocm" + torch.version.hip.replace(".", "")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    roots.append(os.path.join(get_default_build_root(), f"{python}_{tag}"))
    return roots


def fused_adam() -> dict[str, Any]:
    """Whether FusedAdam is installed prebuilt (DS_BUILD_FUSED_ADAM) or JIT-built in the extension folder
    torch uses now (the first entry of :func:`extension_roots`)."""
    try:
        from deepspeed.git_version_info import installed_ops

        prebuilt = bool(installed_ops.get(FUSED_ADAM))
    except ImportError:
        prebuilt = False
    folder = os.path.join(extension_roots()[0], FUSED_ADAM)
    built = os.path.isfile(os.path.join(folder, f"{FUSED_ADAM}.so"))
    return {"prebuilt": prebuilt, "jit_built": built, "folder": folder, "ninja": shutil.which("ninja")}


def _processes_in(folder: str) -> list[int]:
    """Processes whose working directory is ``folder`` (a build's ninja and compilers run there)."""
    found = []
    real = os.path.realpath(folder)
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == real:
                found.append(int(pid))
        except OSError:
            continue
    return found


def build_locks(roots: list[str] | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """Every ``lock`` file in an extension build folder. torch writes it when a build starts and removes it
    when the build ends; a process killed mid-build leaves it behind and every later load of that op waits
    for it forever. A lock is stale when no process works in its folder (after a short grace) or when it is
    older than any build takes."""
    now = time.time() if now is None else now
    locks = []
    for root in dict.fromkeys(roots if roots is not None else extension_roots()):
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name, "lock")
            if not os.path.isfile(path):
                continue
            age = now - os.path.getmtime(path)
            workers = _processes_in(os.path.dirname(path))
            stale = age > STALE_LOCK_AGE_S or (not workers and age > LOCK_GRACE_S)
            why = (
                f"older than any build ({age:.0f} s)"
                if age > STALE_LOCK_AGE_S
                else f"no process is building there (lock {age:.0f} s old)"
                if stale
                else f"a build is running (process {', '.join(map(str, workers))})"
                if workers
                else f"just created ({age:.0f} s ago)"
            )
            locks.append(
                {
                    "path": path,
                    "op": name,
                    "age_s": round(age, 1),
                    "stale": stale,
                    "why": why,
                    "fix": f"rm {path}" if stale else None,
                }
            )
    return locks


# -- the config check -------------------------------------------------------------------------
def _auto_keys(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, Mapping):
        return [k for key, v in value.items() for k in _auto_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if value == "auto" else []


def _without_auto(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_auto(v) for k, v in value.items() if v != "auto"}
    return value


def load_config(path: str) -> dict[str, Any]:
    """A DeepSpeed config file as DeepSpeed reads it (hjson, which accepts plain JSON)."""
    import hjson

    from ds_tensorshard.errors import TensorShardConfigError

    with open(path) as f:
        config = hjson.load(f, object_pairs_hook=dict)
    if not isinstance(config, dict):
        raise TensorShardConfigError(f"{path}: a DeepSpeed config must be a JSON object, got {type(config).__name__}")
    return config


def check_config(config: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
    """Would ``deepspeed.initialize`` accept ``config``? First DeepSpeed's own parse (DeepSpeedConfig), then
    ds_tensorshard's checks (:func:`.config.engine_checks.validate_engine_config`), each reported with its message.
    ``"auto"`` values are the framework's (HF Trainer, Accelerate) to fill; they are listed and left out.
    DeepSpeed checks train_batch_size = micro batch x accumulation x world size; out of a launch it sees one
    rank, so that check is made here at ``world_size`` (not at all without one: a note says so) and DeepSpeed
    is given the per-rank batch sizes."""
    from ds_tensorshard.config.engine_checks import validate_engine_config
    from ds_tensorshard.errors import TensorShardConfigError

    result: dict[str, Any] = {
        "auto_keys": _auto_keys(config),
        "deepspeed": None,
        "tensorshard": None,
        "accepted": False,
    }
    plain = _without_auto(config)
    batch = [
        plain.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ]
    if world_size is not None and all(isinstance(v, int) for v in batch):
        train, micro, gas = batch
        if train != micro * gas * world_size:
            result["deepspeed"] = (
                f"Check batch related parameters. train_batch_size is not equal to "
                f"micro_batch_per_gpu * gradient_acc_step * world_size "
                f"{train} != {micro} * {gas} * {world_size}"
            )
            return result
    if world_size is not None or (isinstance(batch[0], int) and any(isinstance(v, int) for v in batch[1:])):
        if world_size is None:
            result["note"] = "train_batch_size not checked against the other batch sizes: give --world-size"
        plain = {k: v for k, v in plain.items() if k != "train_batch_size"}
    if "train_micro_batch_size_per_gpu" in result["auto_keys"] and "train_batch_size" not in plain:
        plain["train_micro_batch_size_per_gpu"] = 1  # the framework sets it from its own batch size
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig(dict(plain))
        result["deepspeed"] = "accepted"
    except Exception as err:  # DeepSpeed raises assertion, value and pydantic errors alike
        result["deepspeed"] = f"{type(err).__name__}: {err}"
        return result
    try:
        enabled = validate_engine_config(plain)
    except TensorShardConfigError as err:
        result["tensorshard"] = f"TensorShardConfigError: {err}"
        return result
    result["tensorshard"] = (
        "accepted: " + json.dumps(enabled.model_dump())
        if enabled is not None
        else "not enabled (no 'tensorshard' block with \"enabled\": true, or no ZeRO-1/2 optimizer to replace): "
        "DeepSpeed runs as stock"
    )
    result["accepted"] = True
    result["enabled"] = enabled is not None
    if enabled is not None:
        result["comm_backend"] = enabled.comm_backend
        result["split_tensors"] = enabled.split_tensors
    return result


# -- assembling and printing ------------------------------------------------------------------
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
                    TensorShardConfig(**_without_auto(config.get("tensorshard", {}))), _without_auto(config)
                )[0]
            )
        report["plans"] = [plan_report(shapes, n, bucket or DEFAULT_BUCKET_NUMEL, split) for n in world_sizes]
    return report


def format_text(report: Mapping[str, Any]) -> list[str]:
    v, mpi, acc, fa = report["versions"], report["mpi"], report["accelerator"], report["fused_adam"]
    lines = [
        "ds_tensorshard report",
        "-" * 60,
        f"python           {v['python']}",
        f"torch            {v['torch']}" + (f" (CUDA {v['torch_cuda']})" if v["torch_cuda"] else " (CPU build)"),
        f"deepspeed        {v['deepspeed']}"
        + (f"  NOT SUPPORTED: {v['deepspeed_unsupported']}" if v["deepspeed_unsupported"] else "  (supported)"),
        f"ds_tensorshard   {v['ds_tensorshard']}",
    ]
    if "error" in mpi:
        lines.append(f"mpi4py           {mpi.get('mpi4py', '-')}: {mpi['error']}")
    else:
        aware = {
            True: "yes",
            False: "no (CUDA tensors are staged through pinned host memory)",
            None: "unknown (neither mpi4py nor the library tells): treated as no",
        }[mpi.get("cuda_aware")]
        lines += [
            f"mpi4py           {mpi['mpi4py']}",
            f"MPI library      {mpi['library']} (MPI {mpi['standard']})",
            f"CUDA-aware MPI   {aware}",
        ]
    lines.append("launchers        " + ", ".join(f"{k}: {p or 'not found'}" for k, p in report["launchers"].items()))
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
    stale = [lock for lock in report["build_locks"] if lock["stale"]]
    for lock in report["build_locks"]:
        lines.append(
            f"build lock       {lock['path']}: {'STALE, ' if lock['stale'] else ''}{lock['why']}"
            + (
                f"; every later load of {lock['op']} waits on it forever: remove it with `{lock['fix']}`"
                if lock["stale"]
                else ""
            )
        )
    if not report["build_locks"]:
        lines.append("build locks      none")
    if "config" in report:
        cfg = report["config"]
        lines += [
            "-" * 60,
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
    if report.get("plans"):
        from ds_tensorshard.commands.plan_report import format_report

        lines.append("-" * 60)
        for plan in report["plans"]:
            lines += format_report(plan)
    if stale:
        lines += ["-" * 60, f"{len(stale)} stale build lock(s): remove them before the next run"]
    return lines


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
