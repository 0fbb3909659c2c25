"""Whether what this process printed has been read by its launcher, before the job is aborted.

MPICH's mpiexec (hydra) ends at once when a rank calls ``MPI_Abort``: its proxy reads each rank's stdout and stderr
pipes and its PMI socket in one loop, and sends what it reads up one connection, in that order, to mpiexec, which
exits (``exit(exitcode)`` in ``HYD_pmiserv_abort``) at the abort command and drops the output behind it. A rank
that prints its diagnosis and aborts at once loses the diagnosis whenever the proxy reads the abort before the
output (20 aborts in 100 of two bare mpi4py ranks on a loaded machine; the rank's own ``Abort(1) on node 0`` line
goes with it). Output the proxy has read has gone up before any abort the rank sends after: so an aborting rank
waits, for a moment at most, until its pipes are empty.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import sys
import termios

from ds_tensorshard.transports.deadline import wait_with_deadline

READ_S = 2.0  # the longest an aborting rank waits for its launcher to read its output
STDOUT, STDERR = 1, 2


def unread_bytes(fd: int) -> int:
    """The bytes written to ``fd`` that its reader has not read yet where ``fd`` is a pipe; 0 for anything else
    (a terminal, a file: nothing is lost there when the job ends)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, bytes(4)))[0])
    except OSError:
        return 0


def wait_until_read(timeout_s: float = READ_S, fds: tuple[int, ...] = (STDOUT, STDERR)) -> bool:
    """Flush Python's stdout and stderr, then wait until the pipes ``fds`` are read to the end, at most
    ``timeout_s`` (a reader that has stopped reading must not keep the job from ending); whether they were."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    return wait_with_deadline(lambda: not any(unread_bytes(fd) for fd in fds), timeout_s)
