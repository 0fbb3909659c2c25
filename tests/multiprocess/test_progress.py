"""Long commands show progress on a terminal (a pseudo-terminal here) and print none into a pipe or a log:
the demo, ``bench``, ``convert-checkpoint`` and the bar helper itself."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import deepspeed
import torch

from tests.helpers import ROOT
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env
from tests.helpers.tiny_gpt import TinyGPT

BIN = os.path.dirname(sys.executable)
BAR_SCRIPT = (
    "from ds_tensorshard.commands.progress import bar\n"
    "with bar(3, 'work', 'step') as b:\n"
    "    [b.update(1) for _ in range(3)]\n"
    "print('finished')\n"
)


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


def piped(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env or launcher_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def test_bar_on_a_terminal_and_silent_in_a_pipe():
    rc, shown = on_terminal([sys.executable, "-c", BAR_SCRIPT])
    assert rc == 0 and "work: 100%" in shown and "3/3" in shown and "finished" in shown, shown
    quiet = piped([sys.executable, "-c", BAR_SCRIPT])
    assert quiet.returncode == 0 and quiet.stdout == "finished\n" and "work" not in quiet.stderr, quiet
    forced = piped([sys.executable, "-c", BAR_SCRIPT], {**launcher_env(), "DS_TENSORSHARD_PROGRESS": "1"})
    assert "work: 100%" in forced.stdout, forced
    rc, off = on_terminal([sys.executable, "-c", BAR_SCRIPT], {**launcher_env(), "DS_TENSORSHARD_PROGRESS": "0"})
    assert rc == 0 and "work" not in off and "finished" in off, off


def test_convert_checkpoint_progress_on_a_terminal_only(tmp_path, single_rank_world):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, seq=16)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True},
    }
    import ds_tensorshard  # noqa: F401  (registers the plugin)

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randint(0, 64, (1, 16))))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="step1")
    tensors = len([p for p in model.parameters() if p.requires_grad])
    cli = os.path.join(BIN, "ds-tensorshard")
    rc, shown = on_terminal(
        [cli, "convert-checkpoint", str(tmp_path / "ckpt"), str(tmp_path / "zero"), "--to", "zero", "--world-size", "3"]
    )
    assert rc == 0 and "convert to zero: 100%" in shown and "3/3" in shown, shown
    rc, shown = on_terminal(
        [
            cli,
            "convert-checkpoint",
            str(tmp_path / "zero"),
            str(tmp_path / "ts"),
            "--to",
            "tensorshard",
            "--world-size",
            "2",
        ]
    )
    assert rc == 0 and "convert to tensorshard: 100%" in shown and f"{tensors}/{tensors}" in shown, shown
    quiet = piped([cli, "convert-checkpoint", str(tmp_path / "ts"), str(tmp_path / "w.pt"), "--to", "fp32"])
    assert quiet.returncode == 0 and quiet.stdout == f"wrote {tmp_path / 'w.pt'}\n", quiet
    assert "convert to" not in quiet.stderr
    weights = torch.load(tmp_path / "w.pt")
    torch.testing.assert_close(weights["wte.weight"], engine.module.wte.weight.detach().float(), rtol=0, atol=0)


def test_bench_progress_on_a_terminal():
    rc, shown = on_terminal(
        [
            os.path.join(BIN, "ds-tensorshard"),
            "bench",
            "--configs",
            "zero2",
            "ts_torch",
            "--layers",
            "1",
            "--width",
            "32",
            "--vocab",
            "128",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_tty_{os.getpid()}"),
        ]
    )
    assert rc == 0, shown[-3000:]
    assert "bench: 100%" in shown and "2/2" in shown and "ds_tensorshard (torch)" in shown


def test_demo_bar_on_rank_0_of_a_terminal_and_none_in_a_log():
    cmd = [
        os.path.join(BIN, "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "ds_tensorshard.examples.train_gpt",
        "--deepspeed_config",
        "configs/tensorshard_fp32.json",
        "--steps",
        "3",
    ]
    rc, shown = on_terminal(["bash", "-c", f"cd {ROOT} && exec " + " ".join(cmd)])
    assert rc == 0, shown[-3000:]
    assert "train: 100%" in shown and "3/3" in shown and "loss: start" in shown
    assert shown.count("train:   0%") == 1, shown[-3000:]  # one bar: rank 0's
    log = subprocess.run(
        cmd[:4] + [str(free_port())] + cmd[5:],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert log.returncode == 0 and "loss: start" in log.stdout, log.stdout[-3000:] + log.stderr[-3000:]
    assert "train:" not in log.stdout + log.stderr
