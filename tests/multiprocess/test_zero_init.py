"""``deepspeed.zero.Init`` with the tensorshard block (issue 47) against stock's ``zero.Init`` at ZeRO-3, real
processes on gloo (tests/workers/zero_init_worker.py).

A model built under ``zero.Init(config_dict_or_path=config)`` (its weights re-initialized by ``self.apply`` in
``__init__``, as HF's models do) never exists whole on a rank: right after construction each tensor is kept by its
owner. Its parameters gathered with ``GatheredParameters`` are stock's bit for bit, ``GatheredParameters`` with
``modifier_rank=0`` writes rank 0's values to every rank, and the training after it is stock ZeRO-3's bit for bit
(2 ranks: test_stage3's tolerances). Without the block ``zero.Init`` is stock's. The 2 ranks are launched once, every
case in one process group.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks
from tests.multiprocess.test_stage3 import MEMORY_BOUND, TIMEOUT_S, assert_same_training, loader

WORKER = os.path.join(WORKERS, "zero_init_worker.py")
N = 2
DEFAULT = ("", "modify", "module")  # built inside zero.Init; then written with modifier_rank=0; zero.Init(module=)
EXTENDED = ("remote", "nested", "external", "bf16")  # remote_device="cpu"; a zero.Init in another; register_external


def case(mode: str, variant: str) -> str:
    return f"{mode}:{variant}" if variant else mode


def launch(out, variants, extra=()):
    out.mkdir(exist_ok=True)
    cases = [case(mode, v) for mode in ("stock", "ts") for v in variants] + list(extra)
    return loader(out, run_ranks([WORKER, str(out), *cases], N, timeout=TIMEOUT_S, check=False))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("zero_init"), DEFAULT, ["ts:mixed"])


def assert_construction_kept_by_owners(load, variant: str) -> None:
    """Right after construction the fullest rank holds at most 1.10x model/n, in its ``ds_tensor`` only, every
    parameter with an owner; stock's (no block) are stock's slices, ceil(numel/n) on every rank, none owned."""
    ours = [load(case("ts", variant), r) for r in range(N)]
    stock = [load(case("stock", variant), r) for r in range(N)]
    model = stock[0]["built"]["model_numel"]
    sliced = sum(math.ceil(math.prod(shape) / N) for shape in stock[0]["built"]["shapes"].values())
    for result in stock:
        assert result["owned"] == 0, variant
        assert (result["built"]["data_numel"], result["built"]["held_numel"]) == (0, sliced), variant
    fullest = max(r["built"]["held_numel"] for r in ours)
    assert fullest <= MEMORY_BOUND * model / N, f"{variant}: {fullest} > {MEMORY_BOUND} x {model} / {N}"
    assert sum(r["built"]["held_numel"] for r in ours) == model, variant  # each element once
    for result in ours:
        assert result["built"]["model_numel"] == model and result["built"]["data_numel"] == 0, variant
        assert result["owned"] == len(result["built"]["shapes"]), variant


def assert_initial_values_are_stocks(load, variant: str) -> None:
    """The parameters gathered right after construction: stock's bit for bit on every rank; the model's
    ``self.apply`` initialization ran on them (its zeroed biases), not only each layer's own."""
    for rank in range(N):
        ours, stock = load(case("ts", variant), rank), load(case("stock", variant), rank)
        assert ours["initial"].keys() == stock["initial"].keys(), variant
        for name, value in stock["initial"].items():
            assert torch.equal(ours["initial"][name], value), f"{variant} rank {rank} {name}"
        assert not ours["initial"]["blocks.0.qkv.bias"].any(), variant


def assert_trains_as_stock(load, variant: str, dtype: str = "fp32") -> None:
    for rank in range(N):
        ours, stock = load(case("ts", variant), rank), load(case("stock", variant), rank)
        assert_same_training(ours, stock, dtype, f"{case('ts', variant)} rank {rank}", exact=True)


@pytest.mark.parametrize("variant", DEFAULT)
def test_construction_keeps_each_tensor_with_its_owner(runs, variant):
    assert_construction_kept_by_owners(runs, variant)


@pytest.mark.parametrize("variant", DEFAULT)
def test_initial_values_are_stocks(runs, variant):
    assert_initial_values_are_stocks(runs, variant)


@pytest.mark.parametrize("variant", DEFAULT)
def test_trains_as_stock_zero3(runs, variant):
    """Losses, grad norms (2 fp32 ulps), learning rates and every gathered parameter after 3 steps: bit for bit
    stock zero.Init + stock ZeRO-3."""
    assert_trains_as_stock(runs, variant)


@pytest.mark.parametrize("variant", DEFAULT)
def test_parameter_attributes_are_stocks(runs, variant):
    """Right after construction each parameter's ``ds_shape``, ``ds_numel``, ``ds_status`` (released),
    ``ds_persist``, ``ds_id`` order, ``is_external_param``, active modules and ``.shape`` (empty) are stock's."""
    for rank in range(N):
        ours, stock = runs(case("ts", variant), rank)["surface"], runs(case("stock", variant), rank)["surface"]
        assert ours == stock, variant
        assert all(facts[2] == "NOT_AVAILABLE" and facts[-1] == (0,) for facts in ours.values()), variant


def test_modifier_rank_writes_back_to_every_rank(runs):
    """``GatheredParameters(params, modifier_rank=0)``: rank 0's values (every other rank wrote -1) are what every
    rank gathers afterwards, as stock's; the training after it is checked by test_trains_as_stock_zero3."""
    for mode in ("stock", "ts"):
        written = runs(f"{mode}:modify", 0)["written"]
        for rank in range(N):
            result = runs(f"{mode}:modify", rank)
            for name, value in written.items():
                assert torch.equal(result["modified"][name], value), f"{mode} rank {rank} {name}"
                assert not torch.equal(result["modified"][name], result["initial"][name]), f"{mode} {name}"


def test_model_built_by_stocks_zero_init_is_refused_at_initialize(runs):
    """Built under ``zero.Init`` without the block (stock slices), trained with it: refused, naming the parameter."""
    for rank in range(N):
        refused = runs("ts:mixed", rank)["refused"]
        assert "was built under deepspeed.zero.Init without the 'tensorshard' block" in refused, refused
        assert "parameter 'frozen_scale'" in refused, refused  # the first in named_parameters()


@pytest.mark.extended
def test_every_variant_as_stock(tmp_path):
    """``remote_device="cpu"`` (the owners' tensors in host memory), a ``zero.Init`` nested in another,
    ``register_external_parameter``, and the bf16 config (zero.Init builds in bf16): as the default variants."""
    load = launch(tmp_path, EXTENDED)
    for variant in EXTENDED:
        assert_construction_kept_by_owners(load, variant)
        assert_initial_values_are_stocks(load, variant)
        assert_trains_as_stock(load, variant, "bf16" if variant == "bf16" else "fp32")
    for rank in range(N):
        assert load("ts:bf16", rank)["built_dtypes"] == ["torch.bfloat16"]
        assert set(load("ts:remote", rank)["built"]["homes"].values()) == {"cpu"}
        assert "reader.scale" in load("ts:external", rank)["params"]
