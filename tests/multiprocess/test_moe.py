"""DeepSpeed MoE layers (``deepspeed.moe.layer.MoE``) with ds_tensorshard, real processes on gloo: the same
losses, grad norms, parameters and fp32 masters as stock ZeRO-1/2 (moe_worker.py: 2 experts, GAS 2, clipping
1.0, WarmupLR, ``split_params_into_different_moe_groups_for_optimizer``'s param groups, 5 steps).

Dense tensors are planned over the data-parallel group, expert tensors over their expert-data-parallel group:
at 2 ranks with expert parallel size 1 (both experts on both ranks, planned over 2 ranks) and 2 (one expert
per rank, planned over 1), at 4 ranks with expert parallel size 2 (each expert on 2 ranks, planned over them).
A case is DTYPE:MODE:STAGE:EXPERTS:EP:K (K: top-k gating).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import TOLERANCE, assert_run_matches, within_ulps
from tests.helpers.emulated_accelerator import EMULATED
from tests.helpers.ranks import run_ranks

WORKER = os.path.join(WORKERS, "moe_worker.py")
EXPERT = "moe.deepspeed_moe.experts."
DEFAULT = {2: ["fp32:ts:2:2:2:2", "bf16:ts:1:2:1:1"], 4: ["fp32:ts:2:2:2:1"]}  # ~35 s; the rest: MATRIX
MATRIX = {
    2: [f"{d}:ts:{s}:2:{ep}:{k}" for d in ("fp32", "bf16", "fp16") for s in (1, 2) for ep in (1, 2) for k in (1, 2)],
    4: [f"{d}:ts:{s}:2:2:{k}" for d in ("fp32", "bf16") for s in (1, 2) for k in (1, 2)],
}
MATRIX[2] += ["fp32:ts-stripes:2:2:2:2", "bf16:ts-stripes:1:2:1:1"]  # bucket_layout "stripes", both domains
MATRIX[4] += ["fp32:ts-stripes:2:2:2:1"]


def stock_of(case: str) -> str:
    return case.replace(":tsmpi:", ":stock:").replace(":ts-stripes:", ":stock:").replace(":ts:", ":stock:")


def reducing_stock_of(case: str) -> str:
    return stock_of(case).replace(":stock:", ":stock-reduce:")


def spread_measured(world: int, case: str) -> bool:
    """bf16 at 4 ranks: the sums round in another order than stock's, and top-k routing turns that into
    differences of stock's own size; there stock's spread is measured (its second reduction pattern)."""
    return world == 4 and case.startswith("bf16:")


def references(world: int, cases: list[str]) -> list[str]:
    return [*map(stock_of, cases), *(reducing_stock_of(c) for c in cases if spread_measured(world, c))]


def run(out, world: int, cases: list[str]):
    run_ranks([WORKER, str(out), *cases, *references(world, cases)], world)
    return lambda case, rank: torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt")


SPREAD = 4  # bf16 at 4 ranks: differences held to 4x stock's own spread (measured up to 2.0x)


def largest(a: dict, b: dict) -> tuple[float, float]:
    """The largest loss and parameter differences between two runs."""
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    return loss, max((a["params"][n] - v).abs().max().item() for n, v in b["params"].items())


def assert_within_stocks_spread(ours: dict, stock: dict, reducing: dict, where: str) -> None:
    """As close to stock as stock's two reduction patterns (use_multi_rank_bucket_allreduce true and false) are
    to each other: ours is a third summation order, measured up to 2.0x that spread (4 ranks, the matrix), held
    to 4x as compare.py holds measured figures; never held tighter than the bf16 tolerance."""
    tol = TOLERANCE["bf16"]
    torch.testing.assert_close(
        torch.tensor(ours["norms"]), torch.tensor(stock["norms"]), rtol=tol["norm"], atol=0, msg=where
    )
    (loss, param), (stock_loss, stock_param) = largest(ours, stock), largest(reducing, stock)
    assert loss <= max(tol["loss"], SPREAD * stock_loss), f"{where}: losses {loss:.2e}, stock's {stock_loss:.2e}"
    assert param <= max(tol["atol"], SPREAD * stock_param), f"{where}: params {param:.2e}, stock's {stock_param:.2e}"


def assert_matches_stock(load, world: int, case: str) -> None:
    """Every rank against stock's; at 2 ranks bit for bit (norms: 2 fp32 ulps, README), else the fp32/bf16
    tolerances of tests/helpers/compare.py."""
    dtype, _, _, _, ep, _ = case.split(":")
    for rank in range(world):
        ours, stock = load(case, rank), load(stock_of(case), rank)
        where = f"{case} rank {rank}"
        assert (ours["optimizer_class"], stock["optimizer_class"]) == ("TensorShardOptimizer", "DeepSpeedZeroOptimizer")
        if spread_measured(world, case):
            assert_within_stocks_spread(ours, stock, load(reducing_stock_of(case), rank), where)
        else:
            assert_run_matches(ours, stock, dtype, where)
            for name, master in stock["masters"].items():  # safe_get_full_fp32_param, expert tensors included
                tol = TOLERANCE[dtype]
                torch.testing.assert_close(ours["masters"][name], master, rtol=tol["rtol"], atol=tol["atol"], msg=where)
        if world == 2:  # the same sums in the same order as stock's: exact
            assert ours["losses"] == stock["losses"], where
            assert all(torch.equal(ours["params"][n], v) for n, v in stock["params"].items()), where
            assert all(torch.equal(ours["masters"][n], v) for n, v in stock["masters"].items()), where
            assert all(within_ulps(a, b, 2) for a, b in zip(ours["norms"], stock["norms"])), where
        # the plans: dense tensors over every rank, this rank's experts over their expert-data-parallel group
        expert_numel = sum(v.numel() for n, v in ours["params"].items() if n.startswith(EXPERT))
        plans = ours["numel_per_rank"]
        assert sorted(plans) == ["data_parallel", f"ep_size_{ep}"], where
        assert len(plans["data_parallel"]) == world and len(plans[f"ep_size_{ep}"]) == world // int(ep), where
        assert sum(plans[f"ep_size_{ep}"]) == expert_numel, where
        assert sum(plans["data_parallel"]) == sum(v.numel() for v in ours["params"].values()) - expert_numel, where
    if ep != "1":  # the ranks of one expert-parallel group hold different experts, its data-parallel copies equal
        first, second = load(case, 0)["params"], load(case, 1)["params"]
        assert all(not torch.equal(v, second[n]) for n, v in first.items() if n.startswith(EXPERT)), case
        if world == 4:
            third = load(case, 2)["params"]
            assert all(torch.equal(v, third[n]) for n, v in first.items()), case


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """``runs(world)``: the DEFAULT cases and their references at ``world`` ranks, launched once per module."""
    loaded = {}

    def runs(world: int):
        if world not in loaded:
            loaded[world] = run(tmp_path_factory.mktemp(f"moe{world}"), world, DEFAULT[world])
        return loaded[world]

    return runs


@pytest.mark.parametrize("world", sorted(DEFAULT))
def test_moe_trains_as_stock(default_runs, world):
    load = default_runs(world)
    for case in DEFAULT[world]:
        assert_matches_stock(load, world, case)


@pytest.mark.cuda_emulated
@pytest.mark.extended  # CI time
def test_moe_on_emulated_cuda_the_same_training_as_on_the_cpu(tmp_path, default_runs):
    """The expert domains on an emulated CUDA device under NCCL's rules (tests/helpers/emulated_cuda.py): the
    CPU run's losses, norms, parameters and fp32 masters, bit for bit."""
    run_ranks([WORKER, str(tmp_path), *DEFAULT[2]], 2, env=EMULATED)
    cpu = default_runs(2)
    for case in DEFAULT[2]:
        for rank in range(2):
            ours, reference = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt"), cpu(case, rank)
            assert (ours["losses"], ours["norms"]) == (reference["losses"], reference["norms"]), case
            for key in ("params", "masters"):
                assert all(torch.equal(ours[key][n], v) for n, v in reference[key].items()), (case, key)


@pytest.mark.extended
@pytest.mark.parametrize("world", sorted(MATRIX))
def test_moe_matrix_trains_as_stock(tmp_path, world):
    """fp32 and bf16 (and at 2 ranks fp16, its first steps overflowing), stages 1 and 2, top-1 and top-2 gating,
    every expert-parallel size of the world."""
    load = run(tmp_path, world, MATRIX[world])
    for case in MATRIX[world]:
        assert_matches_stock(load, world, case)


@pytest.mark.extended
def test_moe_on_the_mpi_transport_trains_as_stock(tmp_path):
    """The mpi transport (one MPI communicator per expert-data-parallel group), 4 ranks under mpiexec."""
    from tests.multiprocess.test_mpi import mpiexec

    cases = ["fp32:tsmpi:2:2:2:1", "bf16:tsmpi:1:2:2:2"]
    mpiexec([WORKER, str(tmp_path), *cases, *references(4, cases)], 4)
    for case in cases:
        assert_matches_stock(lambda c, rank: torch.load(tmp_path / f"{c.replace(':', '_')}.rank{rank}.pt"), 4, case)
