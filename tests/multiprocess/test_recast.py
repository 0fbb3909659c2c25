"""A module that casts its own parameters in every forward (Switch Transformers' router, ``router_dtype``): stock
ZeRO-1/2 points every parameter back at its flat group after each step, and ds_tensorshard points it back at its
tensor before the update (``datapath/param_homes.py``) and keeps its gradient in the dtype it was planned in, in
every layout: the same losses, norms and parameters as stock at 2 ranks, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.multiprocess
LAYOUTS = ("windows", "stripes", "flat")
SETTINGS = ("1:2", "2:1")  # stage 1 with two micro-steps a step, stage 2 with one


def test_a_module_that_casts_itself_in_forward_trains_as_under_stock_at_two_ranks(tmp_path):
    cases = [f"{mode}:{setting}" for setting in SETTINGS for mode in ("stock", *LAYOUTS)]
    run_ranks([os.path.join(WORKERS, "recast_worker.py"), str(tmp_path), *cases], 2)
    load = lambda case, rank: torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt")  # noqa: E731
    for setting in SETTINGS:
        for rank in range(2):
            stock = load(f"stock:{setting}", rank)
            assert set(stock["router"]) == {"torch.float32"}  # recast in every forward
            assert len(set(stock["norms"])) == 5 and max(stock["norms"]) > 0.5  # clipped at least once
            for layout in LAYOUTS:
                ours = load(f"{layout}:{setting}", rank)
                where = f"{layout}, stage:GAS {setting}, rank {rank}"
                assert ours["losses"] == stock["losses"] and ours["norms"] == stock["norms"], where
                for name, value in stock["params"].items():  # pointed back: bf16 again, stock's values
                    assert ours["params"][name].dtype == value.dtype == torch.bfloat16, (where, name)
                    assert torch.equal(ours["params"][name], value), (where, name)
