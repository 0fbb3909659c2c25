"""Checkpoint files: written completely or not at all, read without running code from them.

A file is written to a temporary name, fsynced, then renamed over the target; its digest goes to
``.<file>.sha256`` beside it the same way (:func:`digest_path`). The leading dot keeps the side file
out of DeepSpeed's own readers, which take every file of a tag folder whose name starts with
``mp_rank_`` or ``zero_pp_rank_`` for a checkpoint file (``ds_to_universal``); a ``<file>.sha256``
of an earlier ds_tensorshard is still checked. Reading checks the digest (when there is one), then
unpickles with ``weights_only=True``: tensors, plain Python values and, for stock DeepSpeed files,
the few DeepSpeed data types they hold (:data:`DEEPSPEED_TYPES`). Anything else is refused, naming
the file and the type, before any of it is built.
"""

from __future__ import annotations

import enum
import hashlib
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ds_tensorshard.errors import CheckpointError

DIGEST_SUFFIX = ".sha256"
_CHUNK = 1 << 22
# Types stock DeepSpeed 0.19 puts in its checkpoints (loss scaler, ZeRO stage, slice addresses);
# unpickling them only sets attributes. ds_tensorshard's own files need none of them.
DEEPSPEED_TYPES = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
DEEPSPEED_ENUMS = tuple(t for t in DEEPSPEED_TYPES if issubclass(t, enum.Enum))


def _enum_member(cls: Any, name: str) -> Any:
    """Stands in for ``builtins.getattr`` while unpickling: some Python releases (3.11.2, Debian 12's, for one;
    not 3.11.7) pickle an int-valued enum member as ``getattr(cls, name)``. Only a member of a DeepSpeed enum
    is given; anything else is refused as the global it asked for."""
    if cls not in DEEPSPEED_ENUMS or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"Unsupported GLOBAL builtins.getattr for {cls!r}, {name!r}")
    return cls[name]


def read_latest(save_dir: str, universal: bool = False) -> str | None:
    """The tag a save dir's ``latest`` (``latest_universal``) file names, or None without that file."""
    latest = os.path.join(save_dir, "latest_universal" if universal else "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def fsync_dir(path: str) -> None:
    """Make the folder holding ``path`` durable (a rename in it survives a crash)."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(write: Callable[[str], None], path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(path)


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

    replace_durably(write, path)


def digest_path(path: str) -> str:
    """Where the digest of the file at ``path`` is recorded: ``.<name>.sha256`` in the same folder."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{DIGEST_SUFFIX}")


def digested_name(entry: str) -> str | None:
    """The file name whose digest a folder entry holds (either naming), or None for any other entry."""
    if not entry.endswith(DIGEST_SUFFIX):
        return None
    name = entry.removesuffix(DIGEST_SUFFIX)
    return name[1:] if name.startswith(".") else name


def recorded_digest(path: str) -> str | None:
    """The digest side file of ``path`` that exists (this naming first, then ``<file>.sha256``), or None."""
    for candidate in (digest_path(path), path + DIGEST_SUFFIX):
        if os.path.isfile(candidate):
            return candidate
    return None


def save_atomic(state_dict: Any, path: str) -> None:
    """torch.save ``state_dict`` to ``path`` atomically, then record its digest."""
    replace_durably(lambda tmp: torch.save(state_dict, tmp), path)
    write_text_atomic(digest_path(path), file_digest(path))


def verify(path: str) -> None:
    """Refuse a missing file, or one whose bytes differ from its recorded digest."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    recorded = recorded_digest(path)
    if recorded is not None:
        with open(recorded) as f:
            expected = f.read().strip()
        if file_digest(path) != expected:
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupt (SHA-256 differs from {recorded})")


def _refusal(path: str, err: Exception) -> CheckpointError:
    found = re.search(r"GLOBAL ([\w.]+)|(?:got|for) <class '([\w.]+)'>", str(err))
    what = next((g for g in found.groups() if g), None) if found else None
    return CheckpointError(
        f"refusing to load checkpoint file {path}: it refers to {what or 'an unknown type'}, "
        "which is not a tensor, a plain Python value or one of DeepSpeed's checkpoint types "
        "(unpickling it could run code from the file)"
    )


def _torch_load(path: str, mmap: bool) -> Any:
    with torch.serialization.safe_globals([*DEEPSPEED_TYPES, (_enum_member, "builtins.getattr")]):
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)


def load(path: str) -> Any:
    """Load a checkpoint file (memory-mapped where its format allows) without running code from it."""
    for mmap in (True, False):
        try:
            return _torch_load(path, mmap)
        except pickle.UnpicklingError as err:
            if re.search(r"GLOBAL|allowlisted|add_safe_globals", str(err)):  # a type outside the allow-list
                raise _refusal(path, err) from None
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
        except RuntimeError as err:
            if mmap and "mmap" in str(err):
                continue  # legacy (non-zip) serialization cannot be memory-mapped
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
        except Exception as err:  # noqa: BLE001 - a damaged file fails in many ways
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
    raise AssertionError("unreachable")


def load_for_deepspeed(path: str, map_location: Any = None) -> Any:
    """The checkpoint engine's ``load`` for ds_tensorshard engines: same safety as :func:`load`."""
    value = load(path)
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return _to(value, torch.device(map_location))
    return value  # DeepSpeed's other map_location (``lambda storage, loc: storage``) leaves tensors as loaded


def _to(value: Any, device: Any) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())  # keeps an OrderedDict ordered
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value
