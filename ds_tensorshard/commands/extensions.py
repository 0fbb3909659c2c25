"""DeepSpeed's JIT-built ops as ``ds-tensorshard report`` sees them: where torch builds them, whether FusedAdam is
built, and the build locks a stopped build leaves behind (every later load of that op waits on them forever)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from ds_tensorshard.build_locks import extension_roots, find

FUSED_ADAM = "fused_adam"


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


def build_locks(roots: list[str] | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """Every ``lock`` file in an extension build folder, judged as ``import ds_tensorshard`` judges it before it
    removes a stale one (:mod:`ds_tensorshard.build_locks`): torch writes it when a build starts and removes it
    when the build ends; a process killed mid-build leaves it behind, and every later load of that op waits for
    it forever."""
    return [
        {
            "path": lock.path,
            "op": lock.op,
            "age_s": lock.age_s,
            "stale": lock.stale,
            "why": lock.why,
            "fix": f"rm {lock.path}" if lock.stale else None,
        }
        for lock in find(roots, now)
    ]
