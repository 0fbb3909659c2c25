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
from tests.helpers.compare import within_ulps
from tests.helpers.ranks import run_ranks
from tests.multiprocess.test_stage3 import MEMORY_BOUND, TIMEOUT_S, assert_same_training, loader
from tests.workers.zero_init_worker import SCALED

WORKER = os.path.join(WORKERS, "zero_init_worker.py")
N = 2
DEFAULT = ("", "modify", "module")  # built inside zero.Init; then written with modifier_rank=0; zero.Init(module=)
EXTENDED = ("remote", "nested", "external", "bf16")  # remote_device="cpu"; a zero.Init in another; register_external
API = "api"  # GatheredParameters(fwd_module=), safe_update_full_grad_vectorized, engine.empty_partition_cache()


def case(mode: str, variant: str) -> str:
    return f"{mode}:{variant}" if variant else mode


def launch(out, variants, extra=()):
    out.mkdir(exist_ok=True)
    cases = [case(mode, v) for mode in ("stock", "ts") for v in variants] + list(extra)
    return loader(out, run_ranks([WORKER, str(out), *cases], N, timeout=TIMEOUT_S, check=False))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("zero_init"), (*DEFAULT, API), ["ts:mixed"])


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


def test_gathered_parameters_with_fwd_module_registers_the_external_parameter(runs):
    """``GatheredParameters([wte.weight], modifier_rank=0, fwd_module=reader)`` right after construction, the
    reader (which reads the embedding's weight in its forward) registered by nothing else: the weight becomes the
    reader's external parameter as under stock, rank 0's write reaches every rank, and the training (each forward
    gathering the weight for the reader: without the registration it reads an empty tensor and fails) is stock's
    bit for bit."""
    first = runs("stock:api", 0)["fwd_module"]
    assert len(first) == 1, first
    for rank in range(N):
        ours, stock = runs("ts:api", rank), runs("stock:api", rank)
        assert ours["fwd_module"] == stock["fwd_module"] == first, rank
        assert torch.equal(ours["modified"]["wte.weight"], 0.5 * ours["initial"]["wte.weight"]), rank
        assert torch.equal(ours["modified"]["wte.weight"], stock["modified"]["wte.weight"]), rank
        assert "reader.scale" in ours["params"], rank
    assert_trains_as_stock(runs, API)


def test_safe_update_full_grad_vectorized_as_stock(runs):
    """``safe_update_full_grad_vectorized`` at stage 3 (``update_fp32_grad_for_param_vectorized``), between each
    boundary's backward and step, on three gradients (the embedding owned in blocks among them): each full gradient
    read back is its factor times the one before, both stock's bit for bit, and the training after is stock's and
    not the same run's without the update."""
    for rank in range(N):
        ours, stock = runs("ts:api", rank)["vectorized"], runs("stock:api", rank)["vectorized"]
        assert ours.keys() == stock.keys() and len(ours) == 6, sorted(ours)
        for key, value in stock.items():
            assert torch.equal(ours[key], value), f"rank {rank} {key}"
        for name, factor in SCALED.items():
            assert torch.equal(ours[f"after {name}"], factor * ours[f"before {name}"]), f"rank {rank} {name}"
            assert ours[f"before {name}"].abs().sum() > 0, f"rank {rank} {name}"
    assert_trains_as_stock(runs, API)
    unscaled, scaled = runs("ts", 0)["losses"], runs("ts:api", 0)["losses"]
    assert unscaled[:2] != scaled[:2] and unscaled[-1] != scaled[-1]  # the write moved step 1 on; the scaling, the rest


def test_empty_partition_cache_releases_every_parameter(runs):
    """``engine.empty_partition_cache()`` after an ``eval()`` + ``no_grad()`` forward (which leaves parameters
    gathered): none is gathered afterwards, as under stock, and each rank holds only what it owns (stock: its
    slices), each element once over the ranks."""
    model = runs("stock:api", 0)["built"]["model_numel"]
    sliced = sum(math.ceil(math.prod(s) / N) for s in runs("stock:api", 0)["built"]["shapes"].values())
    ours = [runs("ts:api", rank)["emptied"] for rank in range(N)]
    stock = [runs("stock:api", rank)["emptied"] for rank in range(N)]
    for rank in range(N):
        assert ours[rank]["available_before"] == stock[rank]["available_before"] > 0, rank
        assert ours[rank]["available_after"] == stock[rank]["available_after"] == 0, rank
        assert stock[rank]["held_after"] == sliced, rank
    assert sum(r["held_after"] for r in ours) == model
    assert max(r["held_after"] for r in ours) <= MEMORY_BOUND * model / N


EMULATED_VARIANTS = (*DEFAULT, API)  # the CPU launch's order: construction owners balance over every model built


@pytest.mark.cuda_emulated
@pytest.mark.extended  # CI time (30 s): its CPU run stays; stage 3 on emulated CUDA stays in test_stage3.py
def test_on_emulated_cuda_construction_and_training_as_on_the_cpu(runs, tmp_path):
    """``zero.Init`` with the block on emulated CUDA under NCCL's rules (tests/helpers/emulated_cuda.py): the model
    built on the rank's device, each tensor kept by its construction owner there; what each rank holds, the values
    gathered after construction and after ``GatheredParameters`` writes, the gradients read and scaled, the
    training and ``empty_partition_cache`` are the CPU run's bit for bit (the same kernels on the same data), the
    norm within 2 ulps."""
    from tests.helpers.emulated_accelerator import EMULATED

    cases = [case("ts", v) for v in EMULATED_VARIANTS]
    load = loader(tmp_path, run_ranks([WORKER, str(tmp_path), *cases], N, timeout=TIMEOUT_S, check=False, env=EMULATED))
    for name in cases:
        for rank in range(N):
            ours, cpu = load(name, rank), runs(name, rank)
            assert set(ours["built"]["homes"].values()) == {"cuda"}, (name, rank)
            assert ours["built"]["pieces"] == cpu["built"]["pieces"], (name, rank)
            assert ours["built"]["held_numel"] == cpu["built"]["held_numel"], (name, rank)
            assert ours["losses"] == cpu["losses"], (name, rank)
            # on accelerators the tensors of 100,000+ elements stay in their blocks (the CPU plans them whole): the
            # norm's partial sums cover other elements, so it may be an ulp apart
            assert all(within_ulps(a, b, 2) for a, b in zip(ours["norms"], cpu["norms"])), (name, rank)
            for key in ("initial", "modified", "params", "vectorized"):
                assert ours.get(key, {}).keys() == cpu.get(key, {}).keys(), (name, key)
                for k, value in cpu.get(key, {}).items():
                    assert torch.equal(ours[key][k].cpu(), value.cpu()), (name, rank, key, k)
            if "emptied" in cpu:  # what a rank holds then is its own pieces: the plan's (the large tensors cut here)
                held = [load(name, r)["emptied"]["held_after"] for r in range(N)]
                assert sum(held) == sum(runs(name, r)["emptied"]["held_after"] for r in range(N)), (name, held)
                assert {**ours["emptied"], "held_after": 0} == {**cpu["emptied"], "held_after": 0}, (name, rank)
            assert ours.get("fwd_module") == cpu.get("fwd_module"), (name, rank)
