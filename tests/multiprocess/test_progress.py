"""Long commands show progress on a terminal (a pseudo-terminal here) and print none into a pipe or a log:
the demo, ``convert-checkpoint`` and the bar helper itself (``bench``: tests/multiprocess/test_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import deepspeed
import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env
from tests.helpers.terminal import on_terminal
from tests.helpers.tiny_gpt import TinyGPT

BIN = os.path.dirname(sys.executable)
BAR_SCRIPT = (
    "from ds_tensorshard.commands.progress import bar\n"
    "with bar(3, 'work', 'step') as b:\n"
    "    [b.update(1) for _ in range(3)]\n"
    "print('finished')\n"
)


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


@pytest.mark.extended  # CI time: the bench's bar on a terminal stays in the default suite
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


@pytest.mark.extended  # the bar on a terminal: also test_bar_on_a_terminal_and_silent_in_a_pipe
def test_demo_bar_on_rank_0_of_a_terminal():
    # none in a log: test_demo_and_cli.py's demo run (its ranks write to files); bench: test_bench.py
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
