"""Collectives launched per training step, counted on real ranks: on the mpi transport one ``Ireduce_scatter``
per bucket and one ``Ibcast`` per owner in it (MPICH's ``Iallgatherv`` was slower, see mpi_comm.py), one reduce
and one broadcast per owner in a bucket on gloo, which groups nothing."""

from __future__ import annotations

import json
import os

import pytest

from ds_tensorshard.transports.torch_comm import ALL_GATHER
from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks
from tests.multiprocess.test_mpi import mpiexec, results

WORKER = os.path.join(WORKERS, "launch_count_worker.py")


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_mpi_transport_launches_one_reduce_scatter_per_bucket(n):
    found = results(mpiexec([WORKER, "--comm-backend", "mpi"], n))
    assert [r["rank"] for r in found] == list(range(n))
    for r in found:
        assert r["segments"] > r["buckets"]  # buckets with several owners: per-owner collectives would be more
        assert r["one_owner"] < r["buckets"]
        for step in r["per_step"]:  # and the norm's all-reduce
            assert step == {"Ireduce_scatter": r["buckets"], "Ibcast": r["segments"], "Iallreduce": 1}, r


@pytest.mark.extended
def test_torch_transport_on_gloo_launches_one_collective_per_owner():
    outputs = run_ranks([WORKER, "--comm-backend", "torch"], 3)
    for output in outputs:
        r = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
        for step in r["per_step"]:
            assert step == {"reduce": r["segments"], "broadcast": r["segments"], "all_reduce": 1}, r


STRIPE_COLLECTIVES = {  # a stripe's reduction, its gather, the norm's all-reduce: by transport
    "mpi": ("Ireduce_scatter_block", "Iallgather", "Iallreduce"),
    "torch": ("all_reduce", ALL_GATHER, "all_reduce"),  # gloo: reduced by all-reduce (measured faster), 3 ranks
}


@pytest.mark.parametrize(
    "backend,layout",
    [
        ("torch", "stripes"),
        ("torch", "flat"),
        pytest.param("mpi", "stripes", marks=pytest.mark.extended),  # mpi: CI time
        pytest.param("mpi", "flat", marks=pytest.mark.extended),
    ],
)
def test_stripes_launch_one_reduction_and_one_gather_per_bucket(backend, layout):
    """``bucket_layout: "stripes"``: every bucket holds a slot of each rank's tensors, so it moves with one
    collective each way at any world size (3 ranks here: a window would need one per owner): on mpi a
    reduce-scatter and an all-gather, on gloo an all-reduce (its reduce-scatter is slower) and an all-gather.
    ``"flat"``: the same reductions, and one gather of the whole parameter storage per step."""
    command = [WORKER, "--comm-backend", backend, "--bucket-layout", layout]
    if backend == "mpi":
        found = results(mpiexec(command, 3))
    else:
        outputs = run_ranks(command, 3)
        found = [
            json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[len("RESULT ") :]) for o in outputs
        ]
    reduction, gather, norm = STRIPE_COLLECTIVES[backend]
    assert [r["rank"] for r in found] == [0, 1, 2]
    for r in found:
        assert r["full"] >= r["buckets"] - 1  # every rank has a slot in every bucket (the last: the fullest's rest)
        assert r["buckets"] >= 3
        expected = {reduction: r["buckets"], gather: r["buckets"] if layout == "stripes" else 1}
        expected[norm] = expected.get(norm, 0) + 1
        for step in r["per_step"]:
            assert step == expected, r
