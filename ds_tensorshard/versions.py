"""The DeepSpeed releases this plugin is tested with, checked at import."""

from __future__ import annotations

import os
import warnings

from ds_tensorshard.errors import UnsupportedDeepSpeedVersion

# [low, high): the oldest and newest release of each series 0.16-0.19 tested (tests/multiprocess/test_versions.py,
# docs/versions.md); the engine differences between them are handled where they arise
SUPPORTED_DEEPSPEED = ((0, 16, 0), (0, 20, 0))
UNTESTED_ENV = "DS_TENSORSHARD_UNTESTED_DEEPSPEED"  # =1: warn instead of refusing (to try another release)


def release(version: str) -> tuple[int, ...]:
    """``"0.19.8+abc"`` -> ``(0, 19, 8)``."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


def installed_release() -> tuple[int, ...]:
    """The installed DeepSpeed's release, for what stock does differently from one release to another."""
    import deepspeed

    return release(deepspeed.__version__)


def check_deepspeed_version(version: str) -> None:
    """Raise with the installed and supported versions unless ``version`` is in the tested range
    (``DS_TENSORSHARD_UNTESTED_DEEPSPEED=1`` turns the refusal into a warning)."""
    parts = release(version)
    low, high = SUPPORTED_DEEPSPEED
    if low <= parts < high:
        return
    spec = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high[:2]))}"
    message = (
        f"ds_tensorshard supports deepspeed {spec} but deepspeed {version} is installed; install a "
        f"supported release (pip install 'deepspeed{spec}')"
    )
    if os.environ.get(UNTESTED_ENV) == "1":
        warnings.warn(f"{message}; going on because {UNTESTED_ENV}=1", stacklevel=2)
        return
    raise UnsupportedDeepSpeedVersion(f"{message} (or set {UNTESTED_ENV}=1 to try it anyway)")


def fp16_refusal(stage: int, version: tuple[int, ...]) -> str | None:
    """Why fp16 at ``stage`` has no stock run to match on DeepSpeed ``version``, or ``None``.

    Measured with torch 2.13.0: stock ZeRO-2 of 0.17.6 up to 0.18.3 accumulates wrong gradients
    (deepspeed#7718); there fp32 and bf16 ZeRO-2 equal stock ZeRO-1, but fp16 ZeRO-2 accumulates in fp32
    unlike ZeRO-1. Stock fp16 ZeRO-1 of 0.17.6 stops on mismatched collectives after a skipped step."""
    if (0, 17, 6) <= version < (0, 18, 0):
        return "stock fp16 ZeRO-1 of this release stops after a skipped step and its ZeRO-2 has deepspeed#7718"
    if stage == 2 and (0, 17, 6) <= version < (0, 18, 3):
        return "stock ZeRO-2 of this release computes wrong gradients (deepspeed#7718, fixed in 0.18.3)"
    return None
