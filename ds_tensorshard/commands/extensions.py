"""DeepSpeed's JIT-built ops as ``ds-tensorshard report`` sees them: where torch builds them, whether FusedAdam is
built, and the build locks a stopped build leaves behind (every later load of that op waits on them forever)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

STALE_LOCK_AGE_S = 1800  # no JIT build of a DeepSpeed op takes this long, even on 2 cores
LOCK_GRACE_S = 120  # a build's lock exists for a moment before its compiler starts
FUSED_ADAM = "fused_adam"


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
