"""Deadlines for the plugin's own collectives, and the diagnosis when one passes.

Every wait of the data path has ``tensorshard.timeout_s`` seconds. When it passes, each rank
that timed out writes where it waits into torch.distributed's key-value store, waits a moment for
the others, and reads theirs back: ranks that wrote nothing have not arrived (stopped, stuck, or
dead), ranks that wrote another place are on another step or bucket. The error names the step,
the bucket and its first tensor, the transport, and those ranks.

The host waits with the deadline on host transports (gloo on CPU, MPI); on an accelerator, where
collectives complete in stream order, :mod:`~ds_tensorshard.transports.watchdog` keeps it without
blocking the training thread. Either way the backend's own timeout errors are recognized
(:func:`is_timeout`) and diagnosed the same.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ds_tensorshard.errors import CollectiveTimeout

if TYPE_CHECKING:
    from ds_tensorshard.transports.protocol import Transport

STORE_PREFIX = "ds_tensorshard/timeout/"
GRACE_S = 3.0  # how long a timed-out rank waits for the others' reports

# The timeout errors of each library, as torch.distributed raises them (PyTorch 2.13):
TIMEOUT_MESSAGES = re.compile(
    "|".join(
        (
            # NCCL, ProcessGroupNCCL.cpp WorkNCCL::checkTimeout (the watchdog's, and a timed or blocking wait's):
            # "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...,
            # Timeout(ms)=600000) ran for 600013 milliseconds before timing out."
            r"Watchdog caught collective operation timeout",
            r"ran for \d+ milliseconds before timing out",
            # NCCL, NCCLUtils C10D_CHECK_TIMEOUT (non-blocking communicator calls): "NCCL timeout in: FILE:LINE"
            r"NCCL timeout in:",
            # gloo and MPI, torch's Work::wait(timeout) (Work.cpp; ProcessGroupGloo and ProcessGroupMPI works):
            # "Operation timed out!"
            r"Operation timed out!",
            # gloo, transport/tcp/unbound_buffer.cc UnboundBuffer::waitRecv/waitSend (the process group's own
            # timeout): "[.../unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
            # and what the other operations of that pair then raise: "Application timeout caused pair closure"
            r"Timed out waiting \d+ms for (recv|send) operation to complete",
            r"Application timeout caused pair closure",
        )
    )
)


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective's timeout as NCCL, gloo or torch's MPI backend reports it (the
    mpi4py transport keeps its own deadline and raises :class:`CollectiveTimeout` itself)."""
    return isinstance(error, CollectiveTimeout) or bool(TIMEOUT_MESSAGES.search(str(error)))


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def missing_ranks(rank: int, world_ranks: list[int], where: str) -> str:
    """Report this rank's place through the store and describe the ranks that are not there too."""
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=GRACE_S))
        store.set(f"{STORE_PREFIX}{rank}", where)
        time.sleep(GRACE_S)
        absent, elsewhere = [], []
        for other in world_ranks:
            key = f"{STORE_PREFIX}{other}"
            if not store.check([key]):
                absent.append(other)
                continue
            theirs = store.get(key).decode()
            if theirs != where:
                elsewhere.append(f"rank {other} waits at {theirs}")
    except Exception as err:  # noqa: BLE001 - the store itself may be out of reach (its host stopped)
        return f"which ranks are missing could not be told ({type(err).__name__}: {err})"
    parts = [f"ranks that have not arrived: {absent}" if absent else "every rank has arrived"]
    return "; ".join(parts + elsewhere)


def wait_with_deadline(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` (which drives progress) until it is true or ``timeout_s`` passes; whether it is done."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause + 1e-5, 1e-4)
    return True


LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, a peer's process gone


def diagnosis(comm: Transport, place: str, what: str) -> str:
    """The message for a collective (``what``, at ``place``) that missed its deadline, naming the missing ranks."""
    return (
        f"ds_tensorshard: {place}: {what} did not complete within tensorshard.timeout_s={comm.timeout_s:g} s on "
        f"the {comm.name} transport; {missing_ranks(comm.global_ranks[comm.rank], comm.global_ranks, place)}"
    )


def wait_or_fail(wait: Callable[[], Any], comm: Transport, where: Callable[[], str]) -> Any:
    """``wait()``; past the deadline (or at the backend's own timeout), or where a peer's process is gone, the
    diagnosis and the transport's ``fail`` (raise or abort)."""
    try:
        return wait()
    except CollectiveTimeout as err:
        comm.fail(diagnosis(comm, where(), str(err)))
    except RuntimeError as err:
        if not any(words in str(err) for words in LOST_PEER):
            raise
        place = where()
        comm.fail(
            f"ds_tensorshard: {place}: a rank was lost on the {comm.name} transport ({str(err)[:300]}); "
            f"{missing_ranks(comm.global_ranks[comm.rank], comm.global_ranks, place)}"
        )
