"""The build locks of DeepSpeed's JIT-built ops: a running build's told from a stopped one's, which is removed.

torch builds an op under a lock file, ``<extensions folder>/<op>/lock`` (``torch.utils.cpp_extension``, its
``FileBaton``): the builder creates the file exclusively and holds it open for the whole build, then closes and
removes it; any process that loads the op meanwhile polls until the file is gone. A builder killed midway leaves
the file behind, and every later load of that op polls forever.

Nothing but its builder opens the file, and the kernel closes a dead process's files: a lock that no process holds
open is a stopped build's. That is read from ``/proc``, twice, a moment apart (a finishing build closes the file an
instant before removing it), where every process that could hold it shows there: a lock of this user (or any, as
root) on a local filesystem. Elsewhere (a network folder, where a build on another host is invisible; another
user's lock; no ``/proc``) a lock is a stopped build's only once it is older than any build takes.
:func:`remove_stopped` judges and removes under an flock on the op's folder, so that two processes never both
remove one lock (the second would remove the next build's).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

STALE_LOCK_AGE_S = 1800  # no JIT build of a DeepSpeed op takes this long, even on 2 cores
SETTLE_S = 1.0  # between the two looks at a lock nobody holds
LOCK = "lock"  # torch's name for it, in the op's build folder
# where every process that can open a file shows in this host's /proc
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "overlay"})


@dataclass(frozen=True)
class BuildLock:
    """One op's build lock: its age, the processes that hold it open, and whether a stopped build left it."""

    path: str
    op: str
    age_s: float
    holders: tuple[int, ...]
    stale: bool
    why: str


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


def lock_paths(roots: list[str] | None = None) -> list[str]:
    """Every op's build lock in ``roots`` (default :func:`extension_roots`)."""
    paths = []
    for root in dict.fromkeys(roots if roots is not None else extension_roots()):
        with contextlib.suppress(OSError):
            paths += [p for name in sorted(os.listdir(root)) if os.path.isfile(p := os.path.join(root, name, LOCK))]
    return paths


def holders(path: str) -> tuple[int, ...] | None:
    """The processes that hold ``path`` open, as this host's ``/proc`` shows them; None without ``/proc``."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target, found = os.path.realpath(path), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(int(pid))
    return tuple(found)


def filesystem(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``: the deepest mount above it)."""
    real, best, kind = os.path.realpath(path), "", None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            point = fields.split()[4].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, rest.split()[0]
    return kind


def _all_holders_visible(path: str, seen: tuple[int, ...] | None) -> bool:
    """Whether every process that could hold ``path`` open shows in :func:`holders`."""
    uid = os.geteuid()
    return seen is not None and uid in (0, os.stat(path).st_uid) and filesystem(path) in LOCAL_FILESYSTEMS


def _look(path: str, now: float | None) -> tuple[BuildLock, int] | None:
    """One look at a lock, with its inode (None if it is gone)."""
    try:
        stat = os.stat(path)
        seen = holders(path)
        visible = _all_holders_visible(path, seen)
    except FileNotFoundError:
        return None
    age = (time.time() if now is None else now) - stat.st_mtime
    if seen:
        stale, why = False, f"a build is running (process {', '.join(map(str, seen))} holds it)"
    elif visible:
        stale, why = True, f"no process holds it: its build was stopped (lock {age:.0f} s old)"
    elif age > STALE_LOCK_AGE_S:
        stale, why = True, f"older than any build ({age:.0f} s)"
    else:
        stale, why = False, f"{age:.0f} s old, its builder not visible from here (stale after {STALE_LOCK_AGE_S} s)"
    op = os.path.basename(os.path.dirname(path))
    return BuildLock(path, op, round(age, 1), seen or (), stale, why), stat.st_ino


def judge(path: str, now: float | None = None, settle_s: float = SETTLE_S) -> BuildLock | None:
    """The lock at ``path`` (None if it is gone): stale only if it still is, the same file, ``settle_s`` later."""
    first = _look(path, now)
    if first is None or not first[0].stale:
        return None if first is None else first[0]
    time.sleep(settle_s)
    second = _look(path, now)
    if second is None:
        return None
    if second[1] != first[1]:  # removed and made again meanwhile: a new build's
        return replace(second[0], stale=False, why="made again just now")
    return second[0]


def find(roots: list[str] | None = None, now: float | None = None) -> list[BuildLock]:
    """Every build lock in ``roots`` (default :func:`extension_roots`), judged."""
    return [lock for path in lock_paths(roots) if (lock := judge(path, now)) is not None]


@contextlib.contextmanager
def _folder_flock(folder: str) -> Iterator[None]:
    """An exclusive flock on ``folder`` (where the filesystem has none, as on NFS for folders: no lock)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the flock


def remove_stopped(roots: list[str] | None = None, settle_s: float = SETTLE_S) -> list[BuildLock]:
    """Remove the build locks in ``roots`` (default :func:`extension_roots`) that stopped builds left (see the
    module's docstring) and return them: run before an op is loaded, this keeps the load from waiting forever."""
    removed = []
    for path in lock_paths(roots):
        with _folder_flock(os.path.dirname(path)):
            lock = judge(path, settle_s=settle_s)
            if lock is None or not lock.stale:
                continue
            try:
                os.remove(path)
            except OSError:  # removed meanwhile, or not ours to remove: then the load waits as before
                continue
            removed.append(lock)
    return removed


def remove_stopped_and_say(roots: list[str] | None = None) -> list[BuildLock]:
    """:func:`remove_stopped`, each removal said on this module's logger (stderr where logging is not set up, so a
    command's stdout stays its result); what ``import ds_tensorshard`` runs."""
    removed = remove_stopped(roots)
    for lock in removed:
        logging.getLogger(__name__).warning(
            f"ds_tensorshard removed the build lock {lock.path} ({lock.why}): no load of {lock.op} waits on it"
        )
    return removed
