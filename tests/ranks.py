"""Start real rank processes for a test: a free port each time, a timeout, all output kept.

Every process a test starts leads a process group of its own; on a timeout, an error or Ctrl-C the
whole group is killed, so that no rank outlives its test (a launcher's ranks included).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    env.update(extra or {})
    return env


def run_ranks(
    args: Sequence[str], world: int, timeout: float = TIMEOUT_S, check: bool = True, env: dict | None = None
) -> list[str]:
    """Run ``python ARGS`` as ``world`` ranks; return each rank's combined output. Kills all on timeout."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=rank_env(r, world, port, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks of {args} did not finish within {timeout}s") from None
    finally:
        for proc in procs:
            kill_group(proc)
    if check:
        for rank, (proc, out) in enumerate(zip(procs, outputs)):
            assert proc.returncode == 0, f"rank {rank} of {args} exited {proc.returncode}:\n{out[-6000:]}"
    return outputs


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group ``proc`` leads, if any of it is still alive, and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_in_group(cmd: Sequence[str], timeout: float = TIMEOUT_S, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, but in a process
    group of its own that is killed whole on a timeout, an error or Ctrl-C."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    finally:
        kill_group(proc)  # a launcher that returned may leave ranks behind: none survives
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args: Any, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """``ds-tensorshard ARGS`` (as ``python -m ds_tensorshard.cli``) through :func:`run_in_group`."""
    return run_in_group([sys.executable, "-m", "ds_tensorshard.cli", *map(str, args)], timeout=timeout, **kwargs)


def launcher_env() -> dict:
    """The environment for a launcher (deepspeed, mpiexec, ds-tensorshard bench) that assigns ranks
    itself: no rank variables, CPU settings, and the virtual environment's executables on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    )
    return env


def run_deepspeed_launcher(args: Sequence[str], num_gpus: int, timeout: float = TIMEOUT_S) -> str:
    """``deepspeed --num_gpus N --master_port P ARGS`` on this machine's CPUs; returns all ranks' output."""
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        str(num_gpus),
        "--master_port",
        str(free_port()),
        *args,
    ]
    proc = run_in_group(cmd, timeout=timeout, env=launcher_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def run_until_one_dies(args: Sequence[str], world: int, timeout: float = TIMEOUT_S) -> list[int]:
    """Run ranks until one of them exits non-zero, then kill the rest (they wait for it forever)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=rank_env(r, world, port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    try:
        while not any(p.poll() not in (None, 0) for p in procs):
            if time.monotonic() > deadline or all(p.poll() == 0 for p in procs):
                raise AssertionError(f"no rank of {args} died within {timeout}s")
            time.sleep(0.2)
        time.sleep(2.0)
    finally:
        for proc in procs:
            kill_group(proc)
    return [p.returncode for p in procs]
