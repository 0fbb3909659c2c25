"""DeepSpeed imported with what it prints while importing on stderr, so that a command's stdout carries only its
result (``ds-tensorshard plan --json | jq``)."""

from __future__ import annotations

import logging
import sys
from types import ModuleType


def import_deepspeed() -> ModuleType:
    """``deepspeed``; where this import is the first, what it prints meanwhile (the accelerator it detected)
    goes to stderr, and its logger then writes to stdout as DeepSpeed's always does."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        import deepspeed
        from deepspeed.utils import logger
    finally:
        sys.stdout = stdout
    for handler in logger.handlers:  # made during the import, pointed at the stderr it found in sys.stdout
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
            handler.setStream(stdout)
    return deepspeed
