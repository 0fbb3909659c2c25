"""How a job that used the plugin starts waiting on its peers and how it ends: each wait has
``tensorshard.timeout_s``, and the end has a fixed order.

At start (:func:`all_arrived`, from ``deepspeed.initialize``): every rank of the torch.distributed world (and of
the MPI world, on the mpi transport) must arrive within ``timeout_s``; a rank that waits longer raises
:class:`~ds_tensorshard.errors.PeerLost` naming the wait and the ranks that have not arrived.

At exit (:func:`close`, an ``atexit`` handler registered with the first transport): Python runs it while the
interpreter is whole, before its finalization, before mpi4py's ``MPI_Finalize`` (a ``Py_AtExit`` hook) and
before the C++ static destructors. In this order:

1. every rank waits for the others (MPI ``Ibarrier`` on the mpi transport, then a torch.distributed barrier),
   at most ``timeout_s`` plus the diagnosis' grace twice over (so that a rank still inside a collective reports
   first); past it the rank names the wait and the ranks that have not arrived, and ends (MPI: ``Abort``, so
   that mpiexec returns; torch: exit status 1) without the steps below, which would wait for them;
2. the plugin's watchdog threads (collectives in stream order, NCCL) are stopped, garbage is collected and the
   torch.distributed process groups are destroyed: gloo's worker threads are joined while they can still take
   the GIL. Left to the interpreter's finalization, a worker thread that
   drops the last reference to a tensor with a Python object asks for the GIL, CPython ends the thread with
   ``pthread_exit`` and its unwinding through a ``noexcept`` frame aborts the process ("terminate called
   without an active exception", exit status 6; pytorch/pytorch#190489);
3. the plugin's MPI communicators are freed and MPI is finalized, after the process groups.

After an uncaught exception nothing is waited for: the others may be waiting inside a collective for this
rank. A script that destroyed its process group itself, or finalized MPI, is left as it is.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
from typing import Any, NoReturn

from ds_tensorshard.errors import CollectiveTimeout, PeerLost
from ds_tensorshard.transports.deadline import GRACE_S, missing_ranks, wait_with_deadline
from ds_tensorshard.transports.pipes import wait_until_read

_registered: list[Any] = []  # the transports opened in this process


def register(comm: Any) -> None:
    """Have :func:`close` end this process's job in order at exit (once, whatever the number of transports)."""
    if not _registered:
        atexit.register(close)
    _registered.append(comm)


def _mpi_world() -> Any | None:
    """MPI's world communicator where a transport of this process uses MPI and MPI is still up."""
    if not any(comm.name == "mpi" for comm in _registered):
        return None
    from mpi4py import MPI

    return None if MPI.Is_finalized() else MPI.COMM_WORLD


def _torch_barrier(timeout_s: float | None) -> None:
    """A barrier of the default group, given up after ``timeout_s`` (a lost peer's gloo error raises at once);
    None: the process group's own timeout."""
    import torch.distributed as tdist

    work = tdist.barrier(async_op=True)
    work.wait() if timeout_s is None else work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def all_arrived(timeout_s: float | None, where: str, mpi: bool, source: str = "tensorshard.timeout_s") -> None:
    """Every rank at ``where`` within ``timeout_s``, or :class:`PeerLost` naming the wait and who is missing."""
    import torch.distributed as tdist

    torch_up = tdist.is_initialized()
    what = "an MPI Ibarrier of MPI_COMM_WORLD"
    try:
        if mpi:
            from mpi4py import MPI

            if not wait_with_deadline(MPI.COMM_WORLD.Ibarrier().Test, timeout_s or float("inf")):
                raise CollectiveTimeout(f"{timeout_s:g} s passed")
        what = "a torch.distributed barrier of the default group"
        if torch_up:
            _torch_barrier(timeout_s)
    except RuntimeError as err:  # CollectiveTimeout, or a lost peer's gloo error
        rank = tdist.get_rank() if torch_up else _mpi_rank()
        missing = missing_ranks(rank, list(range(tdist.get_world_size())), where) if torch_up else ""
        raise PeerLost(
            f"ds_tensorshard: {where}: rank {rank} waited for every rank in {what} for at most "
            f"{_seconds(timeout_s, source)}, which failed ({type(err).__name__}: {str(err)[:300]}); {missing}"
        ) from None


def _seconds(timeout_s: float | None, source: str) -> str:
    return "the process group's timeout" if timeout_s is None else f"{timeout_s:g} s ({source})"


def _mpi_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def fail(message: str, mpi: bool) -> NoReturn:
    """Print ``message`` and end this rank without waiting for anyone: under MPI the whole job (``Abort``, so that
    mpiexec returns; once the launcher has read the message, which mpiexec drops otherwise:
    :mod:`~ds_tensorshard.transports.pipes`), else this process with exit status 1."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if mpi:
        from mpi4py import MPI

        wait_until_read()
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)


def close() -> None:
    """End the job in order: wait for every rank, destroy the process groups, free the plugin's MPI
    communicators, finalize MPI. Registered with :func:`atexit` (a no-op there after an uncaught exception);
    also what ``torch_comm.close_process_group`` does. Without a transport of the plugin the barrier has the
    process group's own timeout."""
    import torch.distributed as tdist

    if getattr(sys, "last_value", None) is not None:
        return
    timeout_s = max(comm.timeout_s for comm in _registered) + 2 * GRACE_S if _registered else None
    mpi_world = _mpi_world()
    if tdist.is_initialized() or mpi_world is not None:
        try:
            where, source = "at exit, before destroying the process group", f"tensorshard.timeout_s + {2 * GRACE_S:g} s"
            all_arrived(timeout_s, where, mpi_world is not None, source)
        except PeerLost as err:
            fail(str(err), mpi_world is not None)
    for comm in _registered:
        if getattr(comm, "watchdog", None) is not None:
            comm.watchdog.stop()
    if tdist.is_initialized():
        gc.collect()  # work objects in reference cycles go now, while gloo can finish with them
        tdist.destroy_process_group()
    if mpi_world is not None:
        for comm in _registered:
            if comm.name == "mpi" and comm.mpi:
                comm.mpi.Free()
        from mpi4py import MPI

        MPI.Finalize()
    _registered.clear()
