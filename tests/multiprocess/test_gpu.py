"""The equivalence run at world size 1 with NCCL and CUDA FusedAdam; skipped without CUDA."""

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks
from tests.workers.equivalence_worker import CASES, GAS, STEPS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL + CUDA FusedAdam)"),
]
# loss atol, param rtol, param atol: fp32 as on the CPU (compare.py); bf16/fp16 parameters to 2 ulps relative
# (2**-7, 2**-9) plus a fifth of an lr step absolute, losses to a few ulps of a loss near 4
TOLERANCE = {"fp32": (1e-5, 1e-5, 5e-6), "bf16": (2e-3, 2**-7, 1e-3), "fp16": (1e-3, 2**-9, 1e-3)}


def test_cuda_equivalence_world_size_1(tmp_path):
    run_ranks(
        [os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *CASES], 1, env={"DS_ACCELERATOR": "cuda"}
    )
    for case in CASES:
        dtype, mode, stage = case.split(":")
        if mode != "ts":
            continue
        ts = torch.load(tmp_path / f"{dtype}_ts_{stage}.rank0.pt")
        stock = torch.load(tmp_path / f"{dtype}_stock_{stage}.rank0.pt")
        loss_atol, rtol, atol = TOLERANCE[dtype]
        assert len(ts["losses"]) == STEPS * GAS
        torch.testing.assert_close(torch.tensor(ts["losses"]), torch.tensor(stock["losses"]), rtol=0, atol=loss_atol)
        for name in stock["params"]:
            torch.testing.assert_close(ts["params"][name], stock["params"][name], rtol=rtol, atol=atol)
