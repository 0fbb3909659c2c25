"""The DeepSpeed and torch releases this plugin is tested with, checked at import."""

from __future__ import annotations

import os
import warnings

from ds_tensorshard.errors import UnsupportedDeepSpeedVersion, UnsupportedTorchVersion

# [low, high): the oldest and newest release of each series 0.16-0.19 tested (tests/multiprocess/test_versions.py,
# docs/versions.md); the engine differences between them are handled where they arise
SUPPORTED_DEEPSPEED = ((0, 16, 0), (0, 20, 0))
UNTESTED_ENV = "DS_TENSORSHARD_UNTESTED_DEEPSPEED"  # =1: warn instead of refusing (to try another release)
# torch: 2.13 (the default suite's) to 2.15 (launch/torch_newest.sh), docs/versions.md
SUPPORTED_TORCH = ((2, 13, 0), (2, 16, 0))
UNTESTED_TORCH_ENV = "DS_TENSORSHARD_UNTESTED_TORCH"


def release(version: str) -> tuple[int, ...]:
    """``"0.19.8+abc"`` -> ``(0, 19, 8)``."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


def installed_release() -> tuple[int, ...]:
    """The installed DeepSpeed's release, for what stock does differently from one release to another."""
    import deepspeed

    return release(deepspeed.__version__)


def _check(package: str, version: str, supported: tuple[tuple[int, ...], ...], env: str, error: type) -> None:
    """Raise ``error`` naming the installed and supported versions unless ``version`` is in ``supported``
    ([low, high)); ``env``=1 turns the refusal into a warning."""
    low, high = supported
    if low <= release(version) < high:
        return
    spec = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high[:2]))}"
    message = (
        f"ds_tensorshard supports {package} {spec} but {package} {version} is installed; install a "
        f"supported release (pip install '{package}{spec}')"
    )
    if os.environ.get(env) == "1":
        warnings.warn(f"{message}; going on because {env}=1", stacklevel=3)
        return
    raise error(f"{message} (or set {env}=1 to try it anyway)")


def check_deepspeed_version(version: str) -> None:
    """The installed DeepSpeed is in the tested range (``DS_TENSORSHARD_UNTESTED_DEEPSPEED=1``: a warning)."""
    _check("deepspeed", version, SUPPORTED_DEEPSPEED, UNTESTED_ENV, UnsupportedDeepSpeedVersion)


def check_torch_version(version: str) -> None:
    """The installed torch is in the tested range (``DS_TENSORSHARD_UNTESTED_TORCH=1``: a warning)."""
    _check("torch", version, SUPPORTED_TORCH, UNTESTED_TORCH_ENV, UnsupportedTorchVersion)


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
