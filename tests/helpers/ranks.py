"""Start real rank processes for a test: a free port each time, a timeout, all output kept.

Every process a test starts leads a process group of its own; on a timeout, an error or Ctrl-C the
whole group is killed, so that no rank outlives its test (a launcher's ranks included).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from ds_tensorshard.bench.runner import kill_group
from tests.helpers import forkserver

TIMEOUT_S = 600
_LAUNCH_PORTS: set[int] = set()  # the ports free_port handed out since remove_launch_segments last ran


# Rendezvous ports come from below the kernel's ephemeral range (32768 and up on Linux), where the many
# connections gloo and MPI open take their local ports: a port asked of the kernel (bind to port 0) and closed
# again could be taken by such a connection before the launch binds it (the rank then fails, its peers wait).
# Each pytest-xdist worker hands out its own block, in turn, from a random start within it.
_PORTS_FROM, _PORT_BLOCK = 10000, 2500
_NEXT_PORT = [random.randrange(_PORT_BLOCK)]  # the next port's place in the block


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port for one launch's rendezvous, from this test worker's own block, that nothing is bound to
    now; its /dev/shm segments go at :func:`remove_launch_segments`."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    start = _PORTS_FROM + _PORT_BLOCK * (int(worker[2:]) % 8 if worker[2:].isdigit() else 0)
    for _ in range(_PORT_BLOCK):
        port = start + _NEXT_PORT[0] % _PORT_BLOCK
        _NEXT_PORT[0] += 1
        if not _port_in_use(port):
            _LAUNCH_PORTS.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {start}-{start + _PORT_BLOCK - 1}")


def launch_segments(port: int) -> list[str]:
    """The shared-memory segments of DeepSpeed's CPU all-reduce op for the launch on ``port``. The op makes
    one per rank (69 MB) wherever ``LOCAL_SIZE`` equals the world size, as the deepspeed launcher sets it,
    names it for ``MASTER_ADDR`` and ``MASTER_PORT``, and never unlinks it."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


def remove_launch_segments() -> None:
    """Remove the segments of every launch on a port :func:`free_port` gave out (none of anyone else's)."""
    for port in _LAUNCH_PORTS:
        for path in launch_segments(port):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    _LAUNCH_PORTS.clear()


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


class Rank:
    """One started rank: forked by a :mod:`forkserver` (pid only) or started as ``python ARGS`` (a Popen)."""

    def __init__(self, args: Sequence[str], env: dict, index: int) -> None:
        self.output = tempfile.NamedTemporaryFile(prefix=f"rank{index}-", suffix=".log")
        server = _server(index, env)
        self.server, self.proc = server, None
        if server is not None:
            self.pid = server.start(list(args), env, self.output.name)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, *args], env=env, stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else self.server.returncode(self.pid, 0.0)

    def wait(self, deadline: float) -> int | None:
        """The exit code, or None if still running at ``deadline`` (a ``time.monotonic()`` value)."""
        while True:
            code = self.poll()
            if code is not None or time.monotonic() >= deadline:
                return code
            if self.server is not None:
                self.server.returncode(self.pid, min(0.5, deadline - time.monotonic()))
            else:
                time.sleep(0.05)

    def kill(self) -> None:
        """Kill the process group this rank leads, if any of it is alive, and reap the rank."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(time.monotonic() + 60)

    def text(self) -> str:
        with open(self.output.name, errors="replace") as f:
            return f.read()


def start_ranks(args: Sequence[str], world: int, env: dict | None = None) -> list[Rank]:
    """``python ARGS`` as ``world`` ranks on a free port, each leading a process group of its own."""
    port = free_port()
    return [Rank(args, rank_env(r, world, port, env), r) for r in range(world)]


def run_ranks(
    args: Sequence[str], world: int, timeout: float = TIMEOUT_S, check: bool = True, env: dict | None = None
) -> list[str]:
    """Run ``python ARGS`` as ``world`` ranks; return each rank's combined output. Kills all on timeout."""
    ranks = start_ranks(args, world, env)
    deadline = time.monotonic() + timeout
    try:
        codes = [rank.wait(deadline) for rank in ranks]
        if None in codes:
            raise AssertionError(f"ranks of {args} did not finish within {timeout}s")
        outputs = [rank.text() for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    if check:
        for r, (code, out) in enumerate(zip(codes, outputs)):
            assert code == 0, f"rank {r} of {args} exited {code}:\n{out[-6000:]}"
    return outputs


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
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{list(cmd)} did not finish within {timeout}s:\n{out[-4000:]}\n{err[-6000:]}") from None
    finally:
        kill_group(proc)  # a launcher that returned may leave ranks behind: none survives
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args: Any, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """``ds-tensorshard ARGS`` (as ``python -m ds_tensorshard.commands.cli``) through :func:`run_in_group`."""
    return run_in_group(
        [sys.executable, "-m", "ds_tensorshard.commands.cli", *map(str, args)], timeout=timeout, **kwargs
    )


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


def run_deepspeed_launcher(args: Sequence[str], num_gpus: int, timeout: float = TIMEOUT_S, check: bool = True) -> str:
    """``deepspeed --num_gpus N --master_port P ARGS`` on this machine's CPUs; returns all ranks' output (stdout;
    ``check=False``: whatever the exit code, stdout then stderr). The launch's /dev/shm segments are removed when it
    ends."""
    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(num_gpus)]
    try:
        proc = run_in_group([*cmd, "--master_port", str(port), *args], timeout=timeout, env=launcher_env())
    finally:
        for path in launch_segments(port):
            os.remove(path)
    if not check:
        return proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def run_until_one_dies(args: Sequence[str], world: int, timeout: float = TIMEOUT_S) -> list[int]:
    """Run ranks until one of them exits non-zero, then kill the rest (they wait for it forever)."""
    ranks = start_ranks(args, world)
    deadline = time.monotonic() + timeout
    try:
        while not any(r.poll() not in (None, 0) for r in ranks):
            if time.monotonic() > deadline or all(r.poll() == 0 for r in ranks):
                raise AssertionError(f"no rank of {args} died within {timeout}s")
            time.sleep(0.2)
        time.sleep(2.0)
    finally:
        for rank in ranks:
            rank.kill()
    return [r.poll() for r in ranks]


class _ForkServer:
    """A :mod:`forkserver` process and the exit codes it has reported."""

    def __init__(self, env: dict) -> None:
        self.startup = forkserver.startup_env(env)
        self.proc = subprocess.Popen(
            [sys.executable, forkserver.__file__],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.codes: dict[int, int] = {}
        self.pending = b""
        self._next(time.monotonic() + 300, "ready")

    def start(self, argv: list[str], env: dict, out: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "out": out}) + "\n").encode())
        self.proc.stdin.flush()
        return self._next(time.monotonic() + 60, "pid")

    def returncode(self, pid: int, wait_s: float) -> int | None:
        if pid not in self.codes:
            self._next(time.monotonic() + wait_s, None)
        return self.codes.get(pid)

    def _next(self, deadline: float, key: str | None) -> int:
        """Read messages until one with ``key`` (returning its value) or, for None, until some arrived or
        ``deadline`` passed."""
        assert self.proc.stdout is not None
        while True:
            arrived = False
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                message, arrived = json.loads(line), True
                if "exited" in message:
                    self.codes[message["exited"]] = message["code"]
                elif key in message:
                    return message[key]
            if arrived and key is None:
                return 0
            left = deadline - time.monotonic()
            if select.select([self.proc.stdout], [], [], max(left, 0.0))[0]:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise AssertionError(f"the fork server (pid {self.proc.pid}) exited {self.proc.wait()}")
                self.pending += chunk
            elif left <= 0:
                if key is None:
                    return 0
                raise AssertionError(f"the fork server (pid {self.proc.pid}) sent no {key!r} in time")

    def close(self) -> None:
        kill_group(self.proc)


_SERVERS: dict[int, _ForkServer] = {}


def _server(index: int, env: dict) -> _ForkServer | None:
    """The fork server for rank ``index`` (one per rank index: each its own hash seed), or None where ``env``
    sets what an interpreter fixes at start-up otherwise than the server was started with (then the rank is
    a fresh ``python``)."""
    server = _SERVERS.get(index)
    if server is None:
        if forkserver.startup_env(env) != forkserver.startup_env(_server_env()):
            return None
        server = _SERVERS[index] = _ForkServer(_server_env())
    return server if forkserver.startup_env(env) == server.startup else None


def _server_env() -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()
