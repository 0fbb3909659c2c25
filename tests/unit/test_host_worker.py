"""The host worker of ZeRO-Offload: tasks in order, off the calling thread, each after its copy's event; what a
task raises comes back at settle()."""

from __future__ import annotations

import threading

import pytest
import torch

from ds_tensorshard.datapath.host_worker import HostWorker
from ds_tensorshard.errors import HostWorkError


class Event:
    """An accelerator event: the worker must synchronize it before the task that reads the copy."""

    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronized")


def test_tasks_run_in_order_on_another_thread_each_after_its_event():
    worker, log, threads = HostWorker(torch.device("cpu")), [], set()
    for index in range(5):

        def task(index=index):
            threads.add(threading.current_thread().name)
            log.append(index)

        worker.submit(task, Event(log) if index % 2 else None)
    worker.settle()
    assert log == [0, "synchronized", 1, 2, "synchronized", 3, 4]
    assert threads == {"ds_tensorshard-host"}
    worker.stop()
    assert worker.thread is None


def test_a_failed_task_is_raised_at_settle_and_the_rest_is_dropped():
    worker, ran = HostWorker(torch.device("cpu")), []
    worker.submit(lambda: ran.append(1))
    worker.submit(lambda: 1 / 0)
    worker.submit(lambda: ran.append(3))
    with pytest.raises(HostWorkError, match="host's part of ZeRO-Offload failed") as err:
        worker.settle()
    assert isinstance(err.value.__cause__, ZeroDivisionError) and ran == [1]
    worker.submit(lambda: ran.append(4))  # the next step's work runs again
    worker.settle()
    assert ran == [1, 4]
