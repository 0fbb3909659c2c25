"""Several models on one plan: initialize_many + step_many with real ranks.

Three TinyGPTs of different sizes, dtypes and stages (fp32 and bf16 at stage 2, fp32 at stage 1)
train in one loop; each must match training it alone under stock ZeRO of its stage, and step_many
must equal stepping the engines one by one.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks
from tests.workers.many_worker import MODELS, assert_each_model_matches_stock, assert_overlapped

WORKER = os.path.join(WORKERS, "many_worker.py")


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.extended)])
def many(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"many{n}")
    for mode in ("stock", "step_many", "one_by_one", "step_many_stripes", "step_many_flat"):
        run_ranks([WORKER, str(out), mode], n)
    return n, lambda mode, rank: torch.load(out / f"{mode}.rank{rank}.pt")


def test_each_model_trains_as_it_would_alone_under_stock_zero(many):
    n, load = many
    for rank in range(n):
        assert_each_model_matches_stock(load("step_many", rank), load("stock", rank))


def test_step_many_with_stripes_trains_as_stock(many):
    n, load = many
    for rank in range(n):
        assert_each_model_matches_stock(load("step_many_stripes", rank), load("stock", rank))


def test_step_many_with_flat_parameters_trains_as_stock(many):
    """Models initialized each alone with flat parameters: step_many leaves each model's gather of its storage
    running while the next model updates, and each trains as it would alone under stock ZeRO."""
    n, load = many
    for rank in range(n):
        flat = load("step_many_flat", rank)
        assert flat["layouts"] == ["flat"] * len(MODELS)
        assert flat["broadcasts_running"] and all(flat["broadcasts_running"])
        assert_each_model_matches_stock(flat, load("stock", rank))


def test_step_many_equals_stepping_one_by_one(many):
    n, load = many
    for rank in range(n):
        a, b = load("step_many", rank), load("one_by_one", rank)
        assert a["losses"] == b["losses"]
        for index in range(len(MODELS)):
            assert all(torch.equal(a["params"][index][k], b["params"][index][k]) for k in a["params"][index])


def test_reductions_and_gathers_overlap_the_other_models_work(many):
    n, load = many
    for rank in range(n):
        assert_overlapped(load("step_many", rank))


def test_one_joint_plan_balanced_over_all_models(many):
    n, load = many
    results = [load("step_many", rank) for rank in range(n)]
    assert all(r["same_plan"] for r in results)
    per_rank = results[0]["numel_per_rank"]
    assert all(r["numel_per_rank"] == per_rank for r in results)
    assert [sum(r["owned_numel"]) for r in results] == per_rank  # each rank owns its joint share, across models
    assert max(per_rank) - min(per_rank) <= 4096  # within the largest tensor of any model
    owners = results[0]["owners"]
    assert all(0 <= o < n for model in owners for o in model)
    assert len({o for model in owners for o in model}) == n
