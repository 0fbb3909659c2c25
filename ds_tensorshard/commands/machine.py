"""What this machine offers ds_tensorshard, for ``ds-tensorshard report``: versions (Python, torch, DeepSpeed,
mpi4py, the MPI library and whether it is CUDA-aware), the launchers on PATH, the accelerator and the transports
that can run here. The MPI library is probed in a child process with a deadline, so a broken MPI cannot hang it."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

MPI_PROBE_TIMEOUT_S = 60
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
