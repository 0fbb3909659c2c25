"""Ownership plan: whole tensors, balanced by element count, deterministic (patent claim 5)."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tensorshard.plan import plan_ownership

sizes = st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=60)
worlds = st.integers(min_value=1, max_value=9)


def named(numels):
    return [(f"t{i:03d}", n) for i, n in enumerate(numels)]


def reference_greedy(tensors, world):
    """Largest-first greedy written the plain way: the bar every plan must meet."""
    loads = [0] * world
    for _, numel in sorted(tensors, key=lambda t: -t[1]):
        loads[loads.index(min(loads))] += numel
    return max(loads)


def test_worked_example_from_docstring():
    plan = plan_ownership([("a", 6), ("b", 4), ("c", 3), ("d", 3)], 2)
    assert dict(plan.owners) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert plan.numel_per_rank == (9, 7)
    assert plan.imbalance == pytest.approx(9 / 8)


@settings(max_examples=300, deadline=None)
@given(sizes, worlds)
def test_every_tensor_owned_whole_by_exactly_one_rank(numels, world):
    tensors = named(numels)
    plan = plan_ownership(tensors, world)
    assert set(plan.owners) == {name for name, _ in tensors}
    assert all(0 <= rank < world for rank in plan.owners.values())
    for rank in range(world):
        assert plan.numel_per_rank[rank] == sum(n for name, n in tensors if plan.owners[name] == rank)
    assert plan.total_numel == sum(numels)


@settings(max_examples=300, deadline=None)
@given(sizes, worlds)
def test_balance_at_least_as_good_as_largest_first_greedy(numels, world):
    tensors = named(numels)
    plan = plan_ownership(tensors, world)
    assert max(plan.numel_per_rank) <= reference_greedy(tensors, world)
    # Graham's bound for largest-first: fullest <= ideal + largest tensor
    assert max(plan.numel_per_rank) <= sum(numels) / world + max(numels)
    assert plan.imbalance >= plan.imbalance_bound - 1e-12


@settings(max_examples=200, deadline=None)
@given(sizes, worlds, st.randoms(use_true_random=False))
def test_same_plan_whatever_the_input_order(numels, world, rnd):
    tensors = named(numels)
    shuffled = list(tensors)
    rnd.shuffle(shuffled)
    assert dict(plan_ownership(tensors, world).owners) == dict(plan_ownership(shuffled, world).owners)


def test_more_ranks_than_tensors_leaves_empty_sets():
    plan = plan_ownership([("a", 5), ("b", 3)], 4)
    assert sorted(plan.numel_per_rank) == [0, 0, 3, 5]
    assert [plan.names_of(r) for r in range(4)] == [["a"], ["b"], [], []]


def test_equal_sizes_tie_break_by_name_then_rank():
    plan = plan_ownership([("z", 4), ("a", 4), ("m", 4)], 2)
    assert dict(plan.owners) == {"a": 0, "m": 1, "z": 0}


def test_owner_accepts_the_parameter_itself():
    model = torch.nn.Linear(4, 3)
    names = {id(p): n for n, p in model.named_parameters()}
    plan = plan_ownership([(n, p.numel()) for n, p in model.named_parameters()], 2, param_names=names)
    assert plan.owner(model.weight) == plan.owner("weight") == 0
    assert plan.owner(model.bias) == 1
    with pytest.raises(KeyError, match="not in this plan"):
        plan.owner(torch.nn.Parameter(torch.zeros(2)))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        plan_ownership([("a", 1)], 0)
    with pytest.raises(ValueError, match="unique"):
        plan_ownership([("a", 1), ("a", 2)], 2)


def test_gpt2_small_shape_is_planned_as_well_as_whole_tensors_allow():
    from ds_tensorshard.examples.gpt import build
    model = build("gpt2-small", device="meta")
    tensors = [(n, p.numel()) for n, p in model.named_parameters()]
    random.Random(0).shuffle(tensors)
    for world in (2, 4, 8):
        plan = plan_ownership(tensors, world)
        assert plan.imbalance <= max(1.001, plan.imbalance_bound + 1e-9), (world, plan.numel_per_rank)
