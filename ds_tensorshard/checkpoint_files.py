"""Checkpoint files written completely or not at all, each with a SHA-256 beside it.

A file is written to a temporary name, fsynced, then renamed over the target; its digest goes to
``<file>.sha256`` the same way. Reading checks the digest (when there is one) before unpickling.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import torch

DIGEST_SUFFIX = ".sha256"
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(write: Callable[[str], None], path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(path)


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_text_atomic(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    _replace_durably(write, path)


def save_atomic(state_dict: Any, path: str) -> None:
    """torch.save ``state_dict`` to ``path`` atomically, then record its digest."""
    _replace_durably(lambda tmp: torch.save(state_dict, tmp), path)
    write_text_atomic(path + DIGEST_SUFFIX, file_digest(path))


def verify(path: str) -> None:
    """Refuse a missing file, or one whose bytes differ from its recorded digest."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    digest_path = path + DIGEST_SUFFIX
    if os.path.isfile(digest_path):
        with open(digest_path) as f:
            expected = f.read().strip()
        if file_digest(path) != expected:
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupt (SHA-256 differs from {digest_path})")


def load(path: str) -> Any:
    """Load a checkpoint file memory-mapped where its format allows; errors name the file."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
    except Exception as err:  # noqa: BLE001 - unpickling errors come in many types
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
