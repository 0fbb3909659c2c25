"""Equivalence with stock DeepSpeed, real processes on gloo: same losses and parameters as ZeRO-1/2.

Each world size is launched once; every rank trains all cases (dtype x stock/tensorshard x stage)
in one process group (see equivalence_worker.py). GAS 2, clipping 1.0, WarmupLR with per-group
peaks, two param groups, tied embedding, a frozen and an unused parameter.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.compare import assert_run_matches
from tests.workers.equivalence_worker import CASES, GAS, STEPS

WORLDS = (2, 3)


@pytest.fixture(scope="module", params=WORLDS)
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


def within_ulps(a: float, b: float, ulps: int) -> bool:
    """Equal, both nan (an overflow step), or within ``ulps`` fp32 units in the last place (2**-23 relative)."""
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= ulps * 2**-23 * abs(b)


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
