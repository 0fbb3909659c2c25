"""A JIT build stopped midway leaves its lock; the next load must not wait on it forever (ds_tensorshard.build_locks).

The loads here are torch's own JIT loader (``torch.utils.cpp_extension.load``, the one DeepSpeed's op builders
call) building a one-line C++ library in a fraction of a second, under the same lock file a DeepSpeed op's build
takes."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
from torch.utils.cpp_extension import load
from torch.utils.file_baton import FileBaton

from ds_tensorshard import build_locks

LOAD_LIMIT_S = 60  # the one-line library builds in well under a second


def stopped_build(folder) -> str:
    """The lock a builder killed midway leaves: torch's own baton taken, and the file closed (by the kernel, as
    the builder died) but never removed."""
    folder.mkdir(parents=True, exist_ok=True)
    baton = FileBaton(str(folder / build_locks.LOCK))
    assert baton.try_acquire()
    os.close(baton.fd)
    return baton.lock_file_path


def load_within(folder, limit_s: float = LOAD_LIMIT_S) -> bool:
    """Whether torch's JIT loader loads a one-line library built in ``folder`` within ``limit_s``; a load that
    waits on a lock no build will remove is let go by removing that lock after the limit."""
    source = folder.parent / "probe.cpp"
    source.write_text('extern "C" int ts_lock_probe() { return 7; }\n')
    name = f"ts_lock_probe_{uuid.uuid4().hex[:8]}"  # a new extension: this process has not loaded it
    loaded: list[str] = []

    def run() -> None:
        try:
            loaded.append(load(name=name, sources=[str(source)], build_directory=str(folder), is_python_module=False))
        except OSError:  # let go: it then finds no library, since nobody built it
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():  # waiting on the lock forever
        os.remove(folder / build_locks.LOCK)
        thread.join(limit_s)
        return False
    return loaded == [str(folder / f"{name}.so")]


def test_a_stopped_builds_lock_is_removed_and_the_next_load_does_not_hang(tmp_path):
    root = tmp_path / "extensions"
    lock = stopped_build(root / "probe")
    found = build_locks.find([str(root)])
    assert [(x.path, x.stale, x.holders) for x in found] == [(lock, True, ())]
    assert found[0].why.startswith("no process holds it: its build was stopped")
    removed = build_locks.remove_stopped([str(root)], settle_s=0.1)  # what every import of ds_tensorshard runs
    assert [x.path for x in removed] == [lock] and not os.path.exists(lock)
    assert load_within(root / "probe")


def test_without_the_removal_the_load_waits_on_that_lock(tmp_path):
    """The hang the removal prevents: torch's loader waits on such a lock for as long as it is there (here
    let go after 2 s)."""
    stopped_build(tmp_path / "extensions" / "probe")
    assert not load_within(tmp_path / "extensions" / "probe", limit_s=2)


def test_a_running_builds_lock_is_left_alone(tmp_path):
    root = tmp_path / "extensions"
    (root / "op").mkdir(parents=True)
    held = os.open(root / "op" / build_locks.LOCK, os.O_CREAT | os.O_EXCL | os.O_RDONLY)  # as torch's builder holds it
    try:
        assert build_locks.remove_stopped([str(root)], settle_s=0.1) == []
        (lock,) = build_locks.find([str(root)])
        assert not lock.stale and lock.holders == (os.getpid(),) and f"process {os.getpid()} holds it" in lock.why
    finally:
        os.close(held)
    assert [x.op for x in build_locks.remove_stopped([str(root)], settle_s=0.1)] == ["op"]  # its builder gone


@pytest.mark.parametrize("kind", ["nfs4", "lustre", None])
def test_where_a_builder_may_not_show_only_a_lock_older_than_any_build_is_stale(tmp_path, monkeypatch, kind):
    """On a network filesystem a build on another host holds its lock out of this host's sight (None: a
    filesystem not found in the mount table): there a lock is stale only once older than any build takes."""
    monkeypatch.setattr(build_locks, "filesystem", lambda path: kind)
    root = tmp_path / "extensions"
    lock = stopped_build(root / "op")
    assert build_locks.remove_stopped([str(root)], settle_s=0.1) == [] and os.path.exists(lock)
    (young,) = build_locks.find([str(root)])
    assert not young.stale and "builder not visible from here" in young.why
    old = time.time() - build_locks.STALE_LOCK_AGE_S - 60
    os.utime(lock, (old, old))
    (removed,) = build_locks.remove_stopped([str(root)], settle_s=0.1)
    assert removed.why.startswith("older than any build") and not os.path.exists(lock)
