"""The deadline on every transport: the backends' own timeout errors become CollectiveTimeout (and so are
diagnosed), and on an accelerator the watchdog keeps the deadline of collectives nobody waits on."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ds_tensorshard.errors import CollectiveTimeout
from ds_tensorshard.transports import deadline
from ds_tensorshard.transports.deadline import is_timeout
from ds_tensorshard.transports.pipes import unread_bytes, wait_until_read
from ds_tensorshard.transports.protocol import Pending
from ds_tensorshard.transports.torch_comm import _completed
from ds_tensorshard.transports.watchdog import POLL_S, Watchdog

# What each library raises when a collective times out, as users see it (torch 2.13; deadline.py cites where
# each is made)
TIMEOUTS = {
    "nccl watchdog": "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
    "nccl watchdog thread": "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with "
    "exception: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=REDUCE, "
    "NumelIn=4000000, NumelOut=4000000, Timeout(ms)=1800000) ran for 1800081 milliseconds before timing out.",
    "nccl non-blocking": "NCCL timeout in: /__w/pytorch/pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:99",
    "gloo timed wait": "Operation timed out!",
    "gloo transport": "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
    "waiting 1800000ms for recv operation to complete",
    "gloo send": "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:136] Timed out waiting 5000ms for send "
    "operation to complete",
    "gloo pair": "Application timeout caused pair closure",
}
NOT_TIMEOUTS = [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5",
    "No backend type associated with device type cpu",
]


@pytest.mark.parametrize("library", sorted(TIMEOUTS))
def test_each_librarys_timeout_error_is_recognized(library):
    assert is_timeout(RuntimeError(TIMEOUTS[library]))


@pytest.mark.parametrize("message", NOT_TIMEOUTS)
def test_other_errors_are_not_taken_for_timeouts(message):
    assert not is_timeout(RuntimeError(message))


class FailingWork:
    """A torch.distributed work whose wait raises ``message`` (as the backend would)."""

    def __init__(self, message: str) -> None:
        self.message, self.waits = message, []

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        raise RuntimeError(self.message)


@pytest.mark.parametrize("library", sorted(TIMEOUTS))
def test_a_timeout_in_either_kind_of_wait_becomes_collective_timeout(library):
    for timeout in (None, 5.0):  # the accelerator's wait in stream order, the host's timed wait
        work = FailingWork(TIMEOUTS[library])
        with pytest.raises(CollectiveTimeout, match="reduce to rank 1"):
            _completed(work, "reduce to rank 1", timeout)
        assert work.waits == [timeout]


def test_another_error_of_a_wait_is_raised_as_it_is():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _completed(FailingWork(NOT_TIMEOUTS[0]), "reduce to rank 1", None)


class Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


class Comm:
    rank, world_size, global_ranks, timeout_s, name, device = 0, 2, [0, 1], 0.3, "torch (nccl)", torch.device("cuda")


def test_the_watchdog_ends_the_process_naming_the_collective_and_the_missing_rank(monkeypatch, capsys):
    monkeypatch.setattr(
        deadline, "missing_ranks", lambda rank, ranks, where: f"ranks that have not arrived: [1] ({where})"
    )
    ended = threading.Event()
    statuses = []
    watchdog = Watchdog(Comm(), end=lambda status: (statuses.append(status), ended.set()))
    finished, stuck = Work(), Work()
    watchdog.watch(finished, Pending(lambda: None), "reduce to rank 0")
    pending = Pending(lambda: None, blocks_host=False).describe_as(lambda: "step 4, reduce of bucket 2 of 9")
    watchdog.watch(stuck, pending, "reduce to rank 1")
    finished.done = True
    assert ended.wait(Comm.timeout_s + 10 * POLL_S + 5)
    assert statuses == [1]
    assert (
        "ds_tensorshard: step 4, reduce of bucket 2 of 9: reduce to rank 1 did not complete within "
        "tensorshard.timeout_s=0.3 s on the torch (nccl) transport; ranks that have not arrived: [1]"
    ) in capsys.readouterr().err
    assert watchdog.entries == [watchdog.entries[0]] and watchdog.entries[0][1] is stuck  # the done one dropped


def test_the_watchdog_leaves_collectives_that_complete_in_time_alone():
    statuses = []
    watchdog = Watchdog(Comm(), end=statuses.append)
    for _ in range(3):
        work = Work()
        watchdog.watch(work, Pending(lambda: None), "broadcast from rank 1")
        time.sleep(Comm.timeout_s / 3)
        work.done = True
    time.sleep(Comm.timeout_s + 3 * POLL_S)
    assert statuses == [] and watchdog.entries == []


def test_the_watchdog_stops_at_the_jobs_end_letting_go_of_its_works():
    """shutdown.close stops each transport's watchdog before destroying the process groups: its thread ends and
    holds no work (a work still in flight is not diagnosed after that)."""
    statuses = []
    watchdog = Watchdog(Comm(), end=statuses.append)
    watchdog.watch(Work(), Pending(lambda: None), "reduce to rank 1")
    thread = watchdog.thread
    assert thread is not None and thread.is_alive()
    watchdog.stop()
    assert not thread.is_alive() and watchdog.entries == [] and watchdog.thread is None
    time.sleep(Comm.timeout_s + 3 * POLL_S)
    assert statuses == []


def test_an_aborting_rank_waits_until_its_output_pipe_is_read_at_most_its_timeout(tmp_path):
    """MPICH's mpiexec drops a rank's output still in its pipe when the rank aborts (transports/pipes.py): the
    rank waits until its pipes are read, and no longer than the timeout when nobody reads them."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"ds_tensorshard: the diagnosis\n")
        assert unread_bytes(write_end) == unread_bytes(read_end) == 30
        started = time.monotonic()
        assert not wait_until_read(0.2, fds=(write_end,))
        assert 0.2 <= time.monotonic() - started < 2
        reader = threading.Timer(0.1, os.read, (read_end, 100))
        reader.start()
        assert wait_until_read(5.0, fds=(write_end,))
        reader.join()
        assert unread_bytes(write_end) == 0
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(tmp_path / "log", "w") as file:  # a file (or a terminal) loses nothing: no wait
        file.write("x")
        file.flush()
        assert unread_bytes(file.fileno()) == 0 and wait_until_read(0.0, fds=(file.fileno(),))
