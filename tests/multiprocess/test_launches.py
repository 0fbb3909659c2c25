"""Collectives launched per training step, counted on real ranks: one per bucket and direction on the mpi
transport (``Ireduce_scatter``; ``Iallgatherv``, or ``Ibcast`` for one owner), one per owner in a bucket on
gloo, which groups nothing."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks
from tests.multiprocess.test_mpi import mpiexec, results

WORKER = os.path.join(WORKERS, "launch_count_worker.py")


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_mpi_transport_launches_two_operations_per_bucket(n):
    found = results(mpiexec([WORKER, "--comm-backend", "mpi"], n))
    assert [r["rank"] for r in found] == list(range(n))
    for r in found:
        assert r["segments"] > r["buckets"]  # buckets with several owners: per-owner collectives would be more
        assert r["one_owner"] < r["buckets"]
        for step in r["per_step"]:
            # a bucket with one owner broadcasts (MPICH's Ibcast is faster there); the norm's all-reduce besides
            expected = {"Ireduce_scatter": r["buckets"], "Iallgatherv": r["buckets"] - r["one_owner"], "Iallreduce": 1}
            assert step == {**expected, **({"Ibcast": r["one_owner"]} if r["one_owner"] else {})}, r


@pytest.mark.extended
def test_torch_transport_on_gloo_launches_one_collective_per_owner():
    outputs = run_ranks([WORKER, "--comm-backend", "torch"], 3)
    for output in outputs:
        r = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
        for step in r["per_step"]:
            assert step == {"reduce": r["segments"], "broadcast": r["segments"], "all_reduce": 1}, r
