"""The DeepSpeed releases this plugin is tested with, checked at import."""
from __future__ import annotations

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))  # [low, high): the 0.19.x series


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed is outside the tested range."""


def check_deepspeed_version(version: str) -> None:
    """Raise with the installed and supported versions unless ``version`` is in the tested range."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_DEEPSPEED
    if not (low <= parts < high):
        raise UnsupportedDeepSpeedVersion(
            f"ds_tensorshard supports deepspeed >={'.'.join(map(str, low))},<{'.'.join(map(str, high))} "
            f"but deepspeed {version} is installed; install a supported release (pip install 'deepspeed>=0.19,<0.20')")
