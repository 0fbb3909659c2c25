"""The DeepSpeed releases this plugin is tested with, checked at import."""

from __future__ import annotations

import os
import warnings

# [low, high): verified with 0.19.8. Through 0.19.0 the engine lacks zero_compute_grad_norm() and sets
# optimizer.is_gradient_accumulation_boundary as a bool instead of calling set_gradient_accumulation_boundary()
# (zero_compute_grad_norm is in 0.19.7, set_gradient_accumulation_boundary in 0.19.6; both untested)
SUPPORTED_DEEPSPEED = ((0, 19, 8), (0, 20, 0))
UNTESTED_ENV = "DS_TENSORSHARD_UNTESTED_DEEPSPEED"  # =1: warn instead of refusing (to try another release)


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed is outside the tested range."""


def check_deepspeed_version(version: str) -> None:
    """Raise with the installed and supported versions unless ``version`` is in the tested range
    (``DS_TENSORSHARD_UNTESTED_DEEPSPEED=1`` turns the refusal into a warning)."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
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
