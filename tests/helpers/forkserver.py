"""Test-only: start rank processes by forking an interpreter that has already imported torch and DeepSpeed.

Every rank a test starts would otherwise spend about 3.3 s of CPU importing torch, DeepSpeed and torch's
compiler (which ``torch.optim.Optimizer`` pulls in) before its first line runs; on 2 cores that was a third
of the suite. A rank forked from here is still a process of its own (own pid, own session, killed whole
on a timeout), and runs its script or module from the start, as ``python ARGS`` would. The server
imports nothing of ds_tensorshard and nothing of the tests, so a run imports the plugin itself or not at
all. One server per rank index: each has its own string-hash seed, as separately started ranks do.

Protocol, one JSON object a line: the client sends ``{"argv", "env", "out"}`` and is answered
``{"pid"}``; when a rank ends the server says ``{"exited": pid, "code": returncode}`` (``-N``: signal N).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys
import traceback

# interpreter-wide state a forked rank cannot change after start: a request that sets these otherwise
# than the server's own environment gets a fresh interpreter instead (see ranks.run_ranks)
STARTUP_KEYS = ("PYTHON", "DS_ACCELERATOR", "OMP_", "MKL_", "TORCH", "CUDA", "LD_")


def startup_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_KEYS)}


def _run(argv: list[str]) -> int:
    """``python ARGV`` in this (forked) interpreter: a script, ``-m module`` or ``-c code``."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()  # as the interpreter sets them
        traceback.print_exc()
        return 1


def _child(request: dict) -> None:
    os.setsid()  # leads a process group of its own, as ranks.run_ranks's processes do
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    code = _run(request["argv"])
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if 0 <= code < 256 else 1)


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    import deepspeed  # noqa: F401  (the imports every rank would repeat)
    import torch._dynamo  # noqa: F401

    _say({"ready": os.getpid()})
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.05)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 1 << 16)
            if not chunk:  # the client is gone: leave the running ranks to it, and stop
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                _say({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
