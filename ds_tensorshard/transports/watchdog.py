"""The deadline of collectives that complete in stream order (an accelerator's: NCCL), kept without blocking the
training thread.

Gradient hooks never wait on the host for a collective there: the current stream waits for it and the host goes
on. So no host wait can time out, and the deadline is kept here: one daemon thread per transport queries each
collective's completion (``work.is_completed()``, a query, never a wait) every :data:`POLL_S` while any is in
flight. One still running ``timeout_s`` after it started is diagnosed as a host wait is
(:func:`~ds_tensorshard.transports.deadline.diagnosis`: the step, the bucket, the ranks that have not arrived),
the message is logged and written to stderr, and the process ends with exit status 1, as NCCL's own watchdog
ends it after the process group's (longer) timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deepspeed.utils import logger

from ds_tensorshard.transports.deadline import diagnosis

if TYPE_CHECKING:
    from ds_tensorshard.transports.protocol import Pending, Transport

POLL_S = 0.1


class Watchdog:
    """Watches the collectives of one transport; ``end(status)`` ends the process (``os._exit``)."""

    def __init__(self, comm: Transport, end: Callable[[int], Any] = os._exit) -> None:
        self.comm, self.end = comm, end
        self.entries: list[tuple[float, Any, Pending, str]] = []  # (started, work, its Pending, what it is)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.stopped = False

    def watch(self, work: Any, pending: Pending, what: str) -> None:
        """Keep ``work``'s deadline from now until it completes."""
        with self.lock:
            self.entries.append((time.monotonic(), work, pending, what))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="ds_tensorshard-watchdog", daemon=True)
                self.thread.start()
        self.wake.set()

    def stop(self) -> None:
        """End the thread and let go of the works it holds (at the job's end, after every rank's last collective:
        :mod:`~ds_tensorshard.transports.shutdown`)."""
        with self.lock:
            thread, self.thread, self.entries, self.stopped = self.thread, None, [], True
        self.wake.set()
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            time.sleep(POLL_S)
            with self.lock:
                if self.stopped:
                    return
                self.entries = [entry for entry in self.entries if not entry[1].is_completed()]
                if not self.entries:
                    self.wake.clear()
                    continue
                started, _, pending, what = self.entries[0]  # the oldest: started first, so due first
            if time.monotonic() - started > self.comm.timeout_s:
                self._fail(pending, what)
                return

    def _fail(self, pending: Pending, what: str) -> None:
        place = pending.where() if pending.where is not None else "a collective of the data path"
        message = diagnosis(self.comm, place, what)
        logger.error(message)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        self.end(1)
