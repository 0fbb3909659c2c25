"""Run a command on a pseudo-terminal, as a user at a terminal would, and keep what it shows."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time

from tests.helpers.ranks import TIMEOUT_S, launcher_env


def on_terminal(cmd: list[str], env: dict | None = None, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """Run ``cmd`` with stdin, stdout and stderr on a new pseudo-terminal; return its exit status and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env or launcher_env(), close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal has exited
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError(f"{cmd} did not finish within {timeout}s")
        return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
