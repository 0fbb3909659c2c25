"""Equivalence with stock DeepSpeed, real processes on gloo: same losses and parameters as ZeRO-1/2.

Each world size is launched once; every rank trains all cases (dtype x stock/tensorshard x stage)
in one process group (see equivalence_worker.py). GAS 2, clipping 1.0, WarmupLR with per-group
peaks, two param groups, tied embedding, a frozen and an unused parameter.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import assert_run_matches, within_ulps
from tests.helpers.emulated_accelerator import EMULATED
from tests.helpers.ranks import run_ranks
from tests.workers.equivalence_worker import (
    CASES,
    FLAT_CASES,
    GAS,
    OFFLOAD_CASES,
    OFFLOAD_EXTENDED,
    STEPS,
    STRIPE_CASES,
)

WORLDS = (2, 3)


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.extended)])  # 3 ranks: CI time
def world(request, equivalence_runs):
    return request.param, equivalence_runs(request.param)


def pairs(n):
    """(tensorshard case, stock case it must equal): the same stage, and for fp32 also ZeRO-2 from stage 1."""
    for case in CASES:
        dtype, mode, stage = case.split(":")
        if mode == "ts":
            yield case, f"{dtype}:stock:{stage}"
            if dtype == "fp32" and stage == "1":
                yield case, "fp32:stock:2"


def test_same_losses_norms_and_parameters_as_stock(world):
    n, load = world
    checked = 0
    for ts_case, stock_case in pairs(n):
        for rank in range(n):
            ts, stock = load(ts_case, rank), load(stock_case, rank)
            assert ts["optimizer_class"] == "TensorShardOptimizer"
            assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer"
            assert len(ts["losses"]) == STEPS * GAS
            assert_run_matches(ts, stock, ts_case.split(":")[0], f"{ts_case} vs {stock_case} rank {rank}")
            if n == 2 and ts_case.split(":")[2] == stock_case.split(":")[2]:  # the README's 2-rank claim
                assert ts["losses"] == stock["losses"], ts_case
                assert all(torch.equal(ts["params"][k], v) for k, v in stock["params"].items()), ts_case
                # the norm's partials cover other elements than stock's (README): 2 fp32 ulps
                assert all(within_ulps(a, b, 2) for a, b in zip(ts["norms"], stock["norms"])), ts_case
            checked += 1
    assert checked == 7 * n


def test_stripes_match_stock(world):
    """``bucket_layout: "stripes"``: each bucket a slot of every rank's tensors, one reduce-scatter and one
    all-gather; the same training as stock (bit for bit at 2 ranks, where a sum of two has one order)."""
    n, load = world
    for case in STRIPE_CASES:
        dtype, _, stage = case.split(":")
        for rank in range(n):
            ours, stock = load(case, rank), load(f"{dtype}:stock:{stage}", rank)
            assert ours["optimizer_class"] == "TensorShardOptimizer"
            assert all(ours["slots"]) and ours["buckets"] > 1, case
            assert ours["slots"] != load(f"{dtype}:ts:{stage}", rank)["slots"]  # windows: slot 0
            assert_run_matches(ours, stock, dtype, f"{case} vs stock rank {rank}")
            if n == 2:
                assert ours["losses"] == stock["losses"], case
                assert all(torch.equal(ours["params"][k], v) for k, v in stock["params"].items()), case


def test_flat_parameters_match_stock(world):
    """``bucket_layout: "flat"``: a flat plan, every trained parameter a view of one storage, reduced by stripes;
    through the shared-memory lane the storage is one segment every rank maps, so each owner's update is every
    rank's and the gather a barrier; the same training as stock (bit for bit at 2 ranks)."""
    n, load = world
    for case in FLAT_CASES:
        dtype, _, stage = case.split(":")
        for rank in range(n):
            ours, stock = load(case, rank), load(f"{dtype}:stock:{stage}", rank)
            assert ours["layout"] == "flat" and ours["in_flat_storage"] == len(ours["blocks"]) == 29, case
            assert all(ours["slots"]) and not ours["flat_by_all_reduce"] and ours["flat_shared"], case
            assert sum(len(b) > 1 for b in ours["blocks"].values()) in range(1, n), case  # split at slot boundaries
            assert_run_matches(ours, stock, dtype, f"{case} vs stock rank {rank}")
            if n == 2:
                assert ours["losses"] == stock["losses"], case
                assert all(torch.equal(ours["params"][k], v) for k, v in stock["params"].items()), case


def test_training_moved_the_weights_but_not_the_frozen_one(world):
    n, load = world
    for case in ("fp32:ts:2", "fp32:stock:2"):
        result = load(case, 0)
        assert torch.equal(result["params"]["frozen_scale"], torch.full((32,), 0.5)), case
        assert result["losses"][-1] < result["losses"][0], case
        # the unused parameter has no gradient, yet AdamW's weight decay moves it, in both
        assert not torch.equal(result["params"]["unused"], result["unused_initial"]), case


def test_fp16_overflow_skips_steps_and_scheduler_like_stock(world):
    n, load = world
    for stage in (1, 2):
        case = f"fp16:ts:{stage}"
        ts = load(case, 0)
        assert ts["skipped_steps"] >= 1
        assert ts["norms"][0] == float("inf")
        assert ts["steps"] == [STEPS - ts["skipped_steps"]]


def test_plan_ownership_state_and_gradients(world):
    n, load = world
    for case in CASES:
        dtype, mode, stage = case.split(":")
        if mode != "ts":
            continue
        per_rank = [load(case, r) for r in range(n)]
        blocks = per_rank[0]["blocks"]
        trainable = set(per_rank[0]["params"]) - {"frozen_scale"}
        assert set(blocks) == trainable  # tied head.weight is wte.weight: listed once
        assert all(r["blocks"] == blocks and r["numel_per_rank"] == per_rank[0]["numel_per_rank"] for r in per_rank)
        for name, cut in blocks.items():  # blocks tile the tensor, each on another rank
            assert [start for _, start, _ in cut] == [0] + [stop for _, _, stop in cut[:-1]], name
            assert cut[-1][2] == per_rank[0]["params"][name].numel() and len({r for r, _, _ in cut}) == len(cut)
        numel = per_rank[0]["numel_per_rank"]
        assert sum(numel) == sum(per_rank[0]["params"][k].numel() for k in trainable)
        assert max(numel) <= 1.02 * sum(numel) / n
        for rank, result in enumerate(per_rank):
            assert result["master_numel"] == numel[rank]  # fp32 masters only for owned tensors
            assert result["state_numel"] == 2 * numel[rank]  # exp_avg + exp_avg_sq only for owned tensors
            assert result["group_lrs"] == [1e-2, 5e-3]
            if stage == "2":  # reduced every micro-step; the model keeps no gradients
                assert result["grads_after_backward"] == [0] * (STEPS * GAS)
            else:  # accumulated in the model until the boundary, then reduced and released
                assert result["grads_after_backward"] == [len(trainable) - 1, 0] * STEPS  # "unused" has none


def assert_offload_matches_stock_offload(load, n: int, cases: list[str]) -> None:
    """Each ds_tensorshard ZeRO-Offload case against stock ZeRO-Offload of the same config (DeepSpeedCPUAdam in
    both): at 2 ranks losses and parameters bit-identical, grad norms within 2 fp32 ulps (the norm's partials
    cover other elements than stock's); at 3 ranks within compare.py's tolerance (another summation order). Each
    step moves each owned gradient to the host once per reduction and each updated tensor back once; a rank's
    last update of a step runs after earlier buckets' broadcasts started (updates pipelined behind them)."""
    for case in (c for c in cases if ":ts" in c):
        dtype, mode, stage = case.split(":")
        reference = f"{dtype}:stock-offload:{stage}"
        for rank in range(n):
            ours, stock = load(case, rank), load(reference, rank)
            assert ours["inner_class"] == stock["inner_class"] == "DeepSpeedCPUAdam", case
            assert (ours["optimizer_class"], stock["optimizer_class"]) == (
                "TensorShardOptimizer",
                "DeepSpeedZeroOptimizer",
            )
            assert_run_matches(ours, stock, dtype, f"{case} vs {reference} rank {rank}")
            if n == 2:
                assert ours["losses"] == stock["losses"], case
                assert all(torch.equal(ours["params"][k], v) for k, v in stock["params"].items()), case
                assert all(within_ulps(a, b, 2) for a, b in zip(ours["norms"], stock["norms"])), case
            size = 4 if dtype == "fp32" else 2
            owned = ours["numel_per_rank"][rank]
            reductions = STEPS * (GAS if stage == "2" else 1)
            crossed = {"to_host": owned * size * (1 + reductions), "to_device": owned * size * STEPS}
            assert ours["host_traffic"] == crossed, case  # the masters' first copy, then every step's
            assert ours["state_numel"] == 2 * owned and ours["master_numel"] == owned
            sent, buckets = ours["last_update_at"]  # clipping on: the norm first, then updates behind broadcasts
            assert buckets >= 3 and 1 <= sent < buckets, (case, rank, ours["last_update_at"])


def test_offload_matches_stock_offload_at_two_ranks(equivalence_runs):
    """fp32 at stage 1 and bf16 at stage 2 (GAS 2, clipping 1.0); the other pairs and 3 ranks: -m extended."""
    assert_offload_matches_stock_offload(equivalence_runs(2), 2, OFFLOAD_CASES)


@pytest.mark.extended
@pytest.mark.parametrize("n", WORLDS)
def test_offload_matrix_matches_stock_offload(tmp_path, n):
    """Every dtype x stage pair of ZeRO-Offload, torch and mpi transports (mpiexec), at 2 and 3 ranks; and with
    stripes."""
    from tests.multiprocess.test_mpi import mpiexec

    cases = OFFLOAD_EXTENDED + OFFLOAD_CASES + ["fp32:ts-stripes-offload:2", "bf16:ts-stripes-offload:1"]
    run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *cases], n)
    mpi_cases = [c.replace(":ts-", ":tsmpi-") for c in OFFLOAD_CASES + OFFLOAD_EXTENDED if ":ts-" in c]
    mpiexec([os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *mpi_cases], n)
    load = lambda case, rank: torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt")  # noqa: E731
    assert_offload_matches_stock_offload(load, n, cases + mpi_cases)


# The emulated-CUDA tier (tests/helpers/emulated_cuda.py): the data path on an emulated CUDA device over a process
# group that holds NCCL's rules, each case bit for bit its CPU run (the same kernels on the same data)
EMULATED_CASES = ["fp32:ts:2", "bf16:ts:1", *STRIPE_CASES, *(c for c in OFFLOAD_CASES if ":ts" in c)]


@pytest.mark.cuda_emulated
def test_on_emulated_cuda_the_same_training_as_on_the_cpu(tmp_path, equivalence_runs):
    """Stages 1 and 2, fp32 and bf16, GAS 2, clipping 1.0, windows and stripes, ZeRO-Offload with pinned host
    masters: every tensor of the data path on the rank's device (offloaded masters and state in pinned host
    memory), every collective on device tensors, and the losses, norms and parameters of the CPU run."""
    run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *EMULATED_CASES], 2, env=EMULATED)
    cpu = equivalence_runs(2)
    for case in EMULATED_CASES:
        offloaded = "-offload" in case
        for rank in range(2):
            ours, reference = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt"), cpu(case, rank)
            assert (ours["losses"], ours["norms"]) == (reference["losses"], reference["norms"]), case
            assert all(torch.equal(ours["params"][k], v) for k, v in reference["params"].items()), case
            where = ["cpu"] if offloaded else [f"cuda:{rank}"]
            assert ours["master_devices"] == ours["state_devices"] == where, case
            assert ours["masters_pinned"] == offloaded, case
            assert ours["host_traffic"] == reference["host_traffic"], case


@pytest.mark.cuda_emulated
@pytest.mark.extended  # CI time (15 s); the emulated equivalence of the default layout stays
def test_on_emulated_cuda_flat_parameters_train_as_on_the_cpu(tmp_path, equivalence_runs):
    """Flat parameters on an accelerator: the storage on the device, the parameters views of it, the gather one
    all-gather in place (NCCL's: the input this rank's slot of the storage itself, no copy; the cost model's route at
    2 ranks), and bit for bit the CPU run (whose storage is shared through the shared-memory lane)."""
    run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *FLAT_CASES], 2, env=EMULATED)
    cpu = equivalence_runs(2)
    for case in FLAT_CASES:
        for rank in range(2):
            ours, reference = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt"), cpu(case, rank)
            assert ours["in_flat_storage"] == reference["in_flat_storage"] == 29, case
            assert (ours["flat_by_all_reduce"], ours["flat_shared"], reference["flat_shared"]) == (False, False, True)
            assert (ours["losses"], ours["norms"]) == (reference["losses"], reference["norms"]), case
            assert all(torch.equal(ours["params"][k], v) for k, v in reference["params"].items()), case
            assert ours["master_devices"] == [f"cuda:{rank}"], case


@pytest.mark.cuda_emulated
@pytest.mark.extended  # CI time (15 s); the emulated equivalence of the default layout stays
def test_on_emulated_cuda_stripes_by_all_reduce_train_as_on_the_cpu(tmp_path, equivalence_runs):
    """Stripes reduced and gathered by all-reduce (on an accelerator the cost model's route for small stripes from 8
    ranks; forced here at 2): device buffers, the gather's -0.0 fill, and bit for bit the CPU run, which at 2 ranks
    on gloo takes the same route."""
    env = EMULATED | {"EQ_STRIPES_BY_ALL_REDUCE": "1"}
    run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path), *STRIPE_CASES], 2, env=env)
    cpu = equivalence_runs(2)
    for case in STRIPE_CASES:
        for rank in range(2):
            ours, reference = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt"), cpu(case, rank)
            assert ours["routes"] == reference["routes"] == [[True, True]] * ours["buckets"], case
            assert (ours["losses"], ours["norms"]) == (reference["losses"], reference["norms"]), case
            assert all(torch.equal(ours["params"][k], v) for k, v in reference["params"].items()), case
            assert ours["master_devices"] == [f"cuda:{rank}"], case
