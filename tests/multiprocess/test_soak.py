"""Soak (``-m soak``, also ``bash launch/soak.sh``): 2,000 steps of TinyGPT at 2 ranks, GAS 2, a checkpoint
every 500 steps, on both transports; one run resumed from step 1,000. The losses match an uninterrupted
stock ZeRO-2 run to the fp32 tolerance, and no rank's peak RSS grows between step 200 and step 2,000 by
more than 2% (no growth from hooks, pending work, cached buffers or step bookkeeping)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import TOLERANCE
from tests.helpers.ranks import free_port, launcher_env, run_ranks

pytestmark = pytest.mark.soak
WORKER = os.path.join(WORKERS, "soak_worker.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
STEPS = 2000


def launch(mode: str, out, *extra) -> dict:
    args = [WORKER, str(out), mode, str(STEPS), *map(str, extra)]
    if mode == "tsmpi":
        proc = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, *args],
            env={**launcher_env(), "MASTER_PORT": str(free_port())},
            capture_output=True,
            text=True,
            timeout=3600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        run_ranks(args, 2, timeout=3600)
    return torch.load(out)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return launch("stock", tmp_path_factory.mktemp("soak") / "stock.pt")


@pytest.mark.parametrize("mode", ["ts", "tsmpi"])
def test_two_thousand_steps_with_checkpoints_and_a_resume_match_stock_without_growing(tmp_path, stock, mode):
    full = launch(mode, tmp_path / "full.pt", "--save", tmp_path / "c")
    assert sorted(full["losses"]) == list(range(STEPS))
    assert sorted(os.listdir(tmp_path / "c"))[:4] == ["latest", "step1000", "step1500", "step2000"]
    from_middle = launch(mode, tmp_path / "middle.pt", "--load", tmp_path / "c", "--tag", "step1000")
    assert sorted(from_middle["losses"]) == list(range(1000, STEPS))
    for step, loss in stock["losses"].items():
        assert abs(full["losses"][step] - loss) <= TOLERANCE["fp32"]["loss"], (step, full["losses"][step], loss)
    assert all(from_middle["losses"][s] == full["losses"][s] for s in from_middle["losses"])  # bit for bit
    for rank, peaks in enumerate(full["peak_rss"]):
        growth = peaks[STEPS] / peaks[200] - 1
        print(
            f"{mode} rank {rank}: peak RSS {peaks[200] / 2**20:.1f} MiB at step 200, "
            f"{peaks[STEPS] / 2**20:.1f} MiB at step {STEPS} ({growth:+.2%})"
        )
        assert growth <= 0.02, (rank, peaks[200], peaks[STEPS])
