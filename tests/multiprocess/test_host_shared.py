"""The shared-memory lane of ranks on one host (:mod:`ds_tensorshard.transports.host_shared`), on real ranks: each
collective exact in its documented order, boxes grown and their names removed, the lane taken only where
``tensorshard.shared_memory`` and the host allow it."""

from __future__ import annotations

import os

import pytest

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks

WORKER = os.path.join(WORKERS, "host_shared_worker.py")


@pytest.mark.parametrize("n", [2, 3])
def test_each_collective_of_the_shared_memory_lane(n):
    for output in run_ranks([WORKER], n):
        assert "OK" in output.splitlines(), output[-3000:]
