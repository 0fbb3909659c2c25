"""The mpi comm backend and MPI launches (pip's mpich): mpiexec, mpiexec -f HOSTFILE, deepspeed --launcher mpich,
python -m ds_tensorshard under mpiexec, and the refusal when MPI and torch.distributed worlds differ."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import assert_full_tensors_match, assert_run_matches
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env, run_in_group, run_ranks
from tests.workers.equivalence_worker import STRIPE_CASES as EQUIVALENCE_STRIPES
from tests.workers.many_worker import assert_each_model_matches_stock, assert_overlapped

BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")
PLAIN = os.path.join(WORKERS, "plain_train.py")
CASES = [f"{d}:tsmpi:{s}" for d in ("fp32", "bf16") for s in (2, 1)]  # compared with the torch runs
STRIPE_CASES = [case.replace(":ts-", ":tsmpi-") for case in EQUIVALENCE_STRIPES]


def mpi_env(port: int) -> dict:
    return {**launcher_env(), "MASTER_PORT": str(port)}


def mpiexec(args, n, extra=()):
    """``mpiexec -n N python -m mpi4py ARGS``: mpi4py's runner aborts the job on a rank's uncaught exception,
    where the other ranks would otherwise wait for it until the timeout."""
    port = free_port()
    proc = run_in_group(
        [MPIEXEC, *extra, "-n", str(n), sys.executable, "-m", "mpi4py", *args], env=mpi_env(port), timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def results(output: str) -> list[dict]:
    return sorted(
        (json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.extended)])  # 3 ranks: CI time
def mpi_world(request, tmp_path_factory, equivalence_runs):
    """The mpi transport's cases under mpiexec; the others (stock, torch transport) from the same session's
    equivalence runs at that world size."""
    n = request.param
    out = tmp_path_factory.mktemp(f"mpi{n}")
    mpiexec([os.path.join(WORKERS, "equivalence_worker.py"), str(out), *CASES, *STRIPE_CASES], n)
    torch_runs = equivalence_runs(n)
    return (
        n,
        lambda case, rank: (
            torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt") if ":tsmpi" in case else torch_runs(case, rank)
        ),
    )


def test_mpi_backend_trains_like_torch_backend_and_stock(mpi_world):
    n, load = mpi_world
    for dtype in ("fp32", "bf16"):
        for mpi_case, reference in [
            (f"{dtype}:tsmpi:2", f"{dtype}:stock:2"),
            (f"{dtype}:tsmpi:2", f"{dtype}:ts:2"),
            (f"{dtype}:tsmpi:1", f"{dtype}:stock:1"),
        ]:
            for rank in range(n):
                ours, ref = load(mpi_case, rank), load(reference, rank)
                assert ours["optimizer_class"] == "TensorShardOptimizer"
                assert_run_matches(ours, ref, dtype, f"{mpi_case} vs {reference} rank {rank}")
                assert ours["state_numel"] == 2 * ours["numel_per_rank"][rank]


def test_mpi_stripes_train_like_stock(mpi_world):
    """``bucket_layout: "stripes"`` on MPI (``Ireduce_scatter_block`` + ``Iallgather`` per bucket): as stock, and
    bit for bit as the torch transport's stripes at 2 ranks (the same sums of two)."""
    n, load = mpi_world
    for mpi_case in STRIPE_CASES:
        dtype, _, stage = mpi_case.split(":")
        for rank in range(n):
            ours, stock = load(mpi_case, rank), load(f"{dtype}:stock:{stage}", rank)
            assert all(ours["slots"]), mpi_case
            assert_run_matches(ours, stock, dtype, f"{mpi_case} vs stock rank {rank}")
            if n == 2:
                assert ours["losses"] == load(mpi_case.replace(":tsmpi-", ":ts-"), rank)["losses"], mpi_case


@pytest.mark.extended  # CI time (20 s): the module runner under the deepspeed launcher stays (test_module_runner)
def test_mpiexec_runs_unmodified_script_through_the_module_runner():
    found = results(mpiexec(["-m", "ds_tensorshard", PLAIN, "--comm-backend", "mpi", "--port", str(free_port())], 2))
    assert [(r["rank"], r["optimizer"], r["transport"]) for r in found] == [
        (0, "TensorShardOptimizer", "MpiComm"),
        (1, "TensorShardOptimizer", "MpiComm"),
    ]
    assert found[0]["params_digest"] == found[1]["params_digest"]


def test_mpiexec_with_hostfile_and_torch_backend(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    found = results(mpiexec(["-m", "ds_tensorshard", PLAIN, "--port", str(free_port())], 2, ["-f", str(hostfile)]))
    assert [(r["rank"], r["transport"]) for r in found] == [(0, "TorchComm"), (1, "TorchComm")]
    assert all(r["shared_memory"] for r in found)  # one host: the shared-memory lane over the torch transport


@pytest.mark.extended  # hostfiles across two hosts: the multihost tier
def test_deepspeed_launcher_mpich_with_hostfile(tmp_path):
    # DeepSpeed 0.19.8's mpich runner breaks on --module (it passes -m to its own helper script), so the
    # runner is given ds_tensorshard/__main__.py as the script, as launch/deepspeed_mpi.sh does
    import ds_tensorshard.__main__ as runner

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [
        os.path.join(BIN, "deepspeed"),
        "--hostfile",
        str(hostfile),
        "--launcher",
        "mpich",
        "--force_multi",
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        runner.__file__,
        PLAIN,
        "--comm-backend",
        "mpi",
    ]
    proc = run_in_group(cmd, env=mpi_env(free_port()), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = results(proc.stdout)
    assert [(r["rank"], r["transport"]) for r in found] == [(0, "MpiComm"), (1, "MpiComm")]


def test_mpi_backend_under_a_non_mpi_launcher_is_refused_with_the_launcher_to_use():
    outputs = run_ranks(["-m", "ds_tensorshard", PLAIN, "--comm-backend", "mpi"], 2, check=False)
    for out in outputs:
        assert "needs the MPI world to be the torch.distributed world" in out, out[-3000:]
        assert "mpiexec -n N python train.py" in out
        assert "RESULT" not in out


@pytest.mark.extended  # CI time: the mpi transport's collectives are counted in test_launches.py
def test_comm_bench_reports_both_backends():
    command = ["-m", "ds_tensorshard.examples.comm_bench", "--numel", "1001", "--repeats", "1"]
    out = mpiexec([*command, "--patterns", "owners", "all_reduce", "--port", str(free_port())], 2)
    rows = [json.loads(line[len("COMM ") :]) for line in out.splitlines() if line.startswith("COMM ")]
    assert [(r["backend"], r["pattern"], r["ranks"], r["numel"]) for r in rows] == [
        ("torch", "owners", 2, 1001),
        ("torch", "all_reduce", 2, 1000),  # a stripe: two equal slots
        ("mpi", "owners", 2, 1001),
        ("mpi", "all_reduce", 2, 1000),
    ]
    assert all(r["median_s"] > 0 for r in rows)


@pytest.mark.extended  # several models on one plan: test_many.py on the torch transport
def test_several_models_on_one_plan_with_the_mpi_backend(tmp_path):
    for mode in ("stock", "step_many_mpi"):
        mpiexec([os.path.join(WORKERS, "many_worker.py"), str(tmp_path), mode], 2)
    for rank in range(2):
        joint = torch.load(tmp_path / f"step_many_mpi.rank{rank}.pt")
        assert_each_model_matches_stock(joint, torch.load(tmp_path / f"stock.rank{rank}.pt"))
        assert_overlapped(joint)


@pytest.mark.extended  # CI time (27 s): -m extended
def test_mpi_backend_honours_communication_dtype_and_stage1_features(tmp_path):
    cases = [
        f"{s}:{m}" for s in ("bf16_comm_fp32", "no_sync_stage1", "bf16_accum_fp32_stage1") for m in ("stock", "tsmpi")
    ]
    mpiexec([os.path.join(WORKERS, "feature_worker.py"), str(tmp_path), *cases], 2)
    for scenario in ("bf16_comm_fp32", "no_sync_stage1", "bf16_accum_fp32_stage1"):
        for rank in range(2):
            ours = torch.load(tmp_path / f"{scenario}_tsmpi.rank{rank}.pt")
            assert ours["optimizer_class"] == "TensorShardOptimizer"
            assert_run_matches(
                ours,
                torch.load(tmp_path / f"{scenario}_stock.rank{rank}.pt"),
                "fp32" if scenario == "no_sync_stage1" else "bf16",
                f"{scenario} rank {rank}",
            )


@pytest.mark.extended  # the accessors: test_full_tensors.py on the torch transport, emulated CUDA too
def test_full_tensor_accessors_on_the_mpi_transport(tmp_path):
    """deepspeed.utils' safe_get_full_* / safe_set_full_* (their all-reduce on the mpi transport) at stage 2 with
    the split embedding: stock's values bit for bit, and the same training after the setters."""
    mpiexec([os.path.join(WORKERS, "full_tensor_worker.py"), str(tmp_path), "fp32:stock:2", "fp32:tsmpi:2"], 2)
    for rank in range(2):
        ours, stock = (torch.load(tmp_path / f"fp32_{mode}_2.rank{rank}.pt") for mode in ("tsmpi", "stock"))
        assert ours["optimizer_class"] == "TensorShardOptimizer" and list(ours["split"]) == ["wte.weight"]
        assert_full_tensors_match(ours, stock, True, f"mpi rank {rank}")
        assert_run_matches(ours, stock, "fp32", f"mpi rank {rank}")
        assert ours["set_read_back"] == stock["set_read_back"] and all(ours["set_read_back"].values())
        assert all(message.startswith(("TensorAccessError", "AssertionError")) for message in ours["refusals"].values())


EMULATED_MPI = ["fp32:tsmpi-stripes:2", "bf16:tsmpi:1"]


@pytest.mark.cuda_emulated
@pytest.mark.extended  # CI time (16 s): the mpi transport's CPU runs stay in the default suite
@pytest.mark.parametrize("mpi_world", [2], indirect=True)
def test_mpi_transport_on_emulated_cuda(mpi_world, tmp_path):
    """The mpi transport on an emulated CUDA device (tests/helpers/emulated_cuda.py) with an MPI taken to be
    CUDA-aware: device buffers go to MPI only once the stream that writes them is synchronized (a slot cloned
    for the all-gather included), 16-bit sums through pinned host memory (their sum is a Python function over
    host buffers); two ranks on two devices. The CPU run's training, bit for bit."""
    n, load = mpi_world
    devices = [
        "-genv",
        "EMULATED_CUDA",
        "1",
        "-genv",
        "EMULATED_CUDA_AWARE_MPI",
        "1",
        "-genv",
        "EMULATED_CUDA_DEVICES",
        "2",
    ]
    mpiexec([os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *EMULATED_MPI], n, devices)
    for case in EMULATED_MPI:
        for rank in range(n):
            ours, reference = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt"), load(case, rank)
            assert (ours["losses"], ours["norms"]) == (reference["losses"], reference["norms"]), case
            assert all(torch.equal(ours["params"][k], v) for k, v in reference["params"].items()), case
            assert ours["master_devices"] == [f"cuda:{rank}"], case


RETURNING = os.path.join(WORKERS, "returning_script.py")
EXIT_REPEATS = 2


@pytest.mark.extended  # CI time (27 s): -m extended
def test_a_script_that_returns_exits_0_with_the_job_ended_in_order():
    """A script that just returns (tests/workers/returning_script.py, mpi transport, no teardown of its own),
    ``EXIT_REPEATS`` times under mpiexec: every launch exits 0, and a handler the script registered before
    ``deepspeed.initialize`` (run after the plugin's) finds the process group destroyed and MPI finalized, while the
    interpreter was whole: gloo's threads cannot outlive it (ds_tensorshard/transports/shutdown.py). The
    multihost tier repeats it across two hosts (tests/multiprocess/test_multihost.py)."""
    codes = []
    for _ in range(EXIT_REPEATS):
        proc = run_in_group(
            [MPIEXEC, "-n", "2", sys.executable, "-m", "ds_tensorshard", RETURNING, "tsmpi"],
            env=mpi_env(free_port()),
            timeout=TIMEOUT_S,
        )
        codes.append(proc.returncode)
        out = proc.stdout + proc.stderr
        assert sorted(re.findall(r"AT EXIT rank=(\d) process_group=False mpi_finalized=True", out)) == ["0", "1"], out
        assert "terminate called" not in out, out[-3000:]
    assert codes == [0] * EXIT_REPEATS, codes
