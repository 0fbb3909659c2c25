"""The host's part of the gradient hooks under ZeRO-Offload, off the autograd thread.

A hook only starts work: a reduced segment's copy to pinned host memory (non-blocking, an event recorded after
it) and, for the host, a task. One worker thread runs the tasks in the order given, each after the event of the
copy it reads: adding the segment into the host gradient buffers and, where the step allows it
(:mod:`~ds_tensorshard.datapath.early_update`), the host optimizer's update of the tensors it completes. So
backward never waits on the host for a copy, nor for the host optimizer. :meth:`HostWorker.settle` waits until
every task given so far is done (the step does, before anything reads the host buffers) and raises there what a
task raised.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from ds_tensorshard.errors import HostWorkError


class HostWorker:
    """Runs tasks in order on one daemon thread, each once its ``event`` (if any) is synchronized; the thread's
    current device is ``device`` (the engine's), where its tasks copy updated tensors to."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tasks: queue.Queue[tuple[Any, Callable[[], None]] | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    def submit(self, task: Callable[[], None], event: Any = None) -> None:
        """Run ``task`` after the tasks given before it, once ``event`` (an accelerator event) has completed."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="ds_tensorshard-host", daemon=True)
            self.thread.start()
        self.tasks.put((event, task))

    def _run(self) -> None:
        if self.device.type != "cpu" and self.device.index is not None:
            get_accelerator().set_device(self.device.index)
        while True:
            item = self.tasks.get()
            try:
                if item is None:
                    return
                event, task = item
                if self.failure is None:  # after a failure the rest is dropped: the step raises it
                    if event is not None:
                        event.synchronize()
                    task()
            except BaseException as err:  # noqa: BLE001 - raised again on the training thread, at settle()
                self.failure = err
            finally:
                self.tasks.task_done()

    def settle(self) -> None:
        """Wait for every task given so far; raise what one of them raised."""
        if self.thread is not None:
            self.tasks.join()
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise HostWorkError("ds_tensorshard: the host's part of ZeRO-Offload failed in backward") from failure

    def stop(self) -> None:
        """End the thread once its tasks are done (shutdown)."""
        if self.thread is not None:
            self.tasks.put(None)
            self.thread.join()
            self.thread = None
