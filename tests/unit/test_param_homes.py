"""A parameter whose ``.data`` was replaced after initialize is pointed back at its home before an update, as
stock ZeRO-1/2 points every parameter back at its flat group after each step."""

from __future__ import annotations

import pytest
import torch

from ds_tensorshard.datapath.flat_parameters import FlatParameters
from ds_tensorshard.datapath.flat_plan import plan_flat
from ds_tensorshard.datapath.param_homes import ParameterHomes
from ds_tensorshard.examples.host_cost import InstantComm
from tests.unit.test_flat import _model_params
from tests.workers.recast_worker import train_case


def test_a_parameter_given_new_storage_is_pointed_back_at_its_home():
    params, before = _model_params()
    plan = plan_flat([(n, tuple(p.shape)) for n, p in params.items()], 2, {id(p): n for n, p in params.items()})
    flat = FlatParameters(list(params.values()), plan, InstantComm(2))
    homes = ParameterHomes(list(params.values()))
    params["b"].data = torch.zeros(5)  # new storage
    params["w"].data = params["w"].data.to(torch.float64)  # a cast in forward: a copy in another dtype
    homes.restore([params["b"]])
    assert params["b"].data_ptr() == flat.storage.data_ptr() + plan.flat_offsets["b"] * 4
    assert params["w"].dtype == torch.float64  # not asked for
    homes.restore()
    base = flat.storage.data_ptr()
    for (name, param), value in zip(params.items(), before):  # in place again, the storage's values
        assert param.data_ptr() == base + plan.flat_offsets[name] * 4 and param.dtype == torch.float32
        assert torch.equal(param.data, value)
    flat.move(lambda t: t.clone())  # offload_states moves the storage: the homes follow
    homes.follow()
    params["b"].data = torch.zeros(5)
    homes.restore()
    assert params["b"].data_ptr() == flat.storage.data_ptr() + plan.flat_offsets["b"] * 4


@pytest.mark.parametrize("layout", ["windows", "stripes", "flat"])
def test_a_module_that_casts_itself_in_forward_trains_as_under_stock(layout):
    """bf16, one rank, clipped (tests/workers/recast_worker.py's training, in this process): the router's .data is
    an fp32 copy after each forward; stock ZeRO-2 points every parameter back at its flat group after each step (the
    router trains at bf16 precision, its fp32 master keeping the update's precision), and ds_tensorshard does the
    same in every layout: the same losses, norms and parameters, bit for bit. (2 ranks: tests/multiprocess/
    test_recast.py.)"""
    stock, ours = (train_case(f"{mode}:2:1", 1, 0) for mode in ("stock", layout))
    assert ours["losses"] == stock["losses"] and len(set(stock["losses"])) == len(stock["losses"])
    assert ours["norms"] == stock["norms"] and set(stock["router"]) == {"torch.float32"}
    assert all(p.dtype == torch.bfloat16 for p in stock["params"].values())  # pointed back: bf16 again
    for name, value in stock["params"].items():
        assert ours["params"][name].dtype == value.dtype and torch.equal(ours["params"][name], value), name
