"""Ownership plan: whole tensors where they fit, dim-0 blocks where they cannot; balanced, deterministic."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tensorshard.commands.models import preset_shapes
from ds_tensorshard.datapath.plan import TARGET_IMBALANCE, plan_ownership
from ds_tensorshard.errors import PlanError

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
    plan = plan_ownership([("a", 6), ("b", 4), ("c", 3), ("d", 3)], 2, split="never")
    assert dict(plan.owners) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert plan.numel_per_rank == (9, 7)
    assert plan.imbalance == pytest.approx(9 / 8)
    auto = plan_ownership([("a", 6), ("b", 4), ("c", 3), ("d", 3)], 2)
    assert auto.owners == {"a": 0, "b": 1, "c": 1} and auto.split == {"d": 2}
    assert [(b.rank, b.start, b.stop) for b in auto.blocks["d"]] == [(0, 0, 2), (1, 2, 3)]
    assert auto.numel_per_rank == (8, 8)


@settings(max_examples=300, deadline=None)
@given(sizes, worlds)
def test_every_tensor_owned_whole_by_exactly_one_rank(numels, world):
    tensors = named(numels)
    plan = plan_ownership(tensors, world, split="never")
    assert set(plan.owners) == {name for name, _ in tensors}
    assert all(0 <= rank < world for rank in plan.owners.values())
    for rank in range(world):
        assert plan.numel_per_rank[rank] == sum(n for name, n in tensors if plan.owners[name] == rank)
    assert plan.total_numel == sum(numels)


@settings(max_examples=300, deadline=None)
@given(sizes, worlds)
def test_whole_plan_matches_largest_first_greedy(numels, world):
    tensors = named(numels)
    plan = plan_ownership(tensors, world, split="never")
    assert max(plan.numel_per_rank) == reference_greedy(tensors, world)
    # Graham's bound for largest-first: fullest <= ideal + largest tensor
    assert max(plan.numel_per_rank) <= sum(numels) / world + max(numels)


@settings(max_examples=300, deadline=None)
@given(sizes, worlds, st.integers(min_value=1, max_value=8))
def test_auto_is_the_whole_plan_when_that_is_balanced_else_splits_to_the_target(numels, world, row):
    tensors = [(name, (n, row)) for name, n in named(numels)]  # n rows of `row` elements
    whole = plan_ownership(tensors, world, split="never")
    auto = plan_ownership(tensors, world, split="auto")
    total = sum(n * row for n in numels)
    assert auto.total_numel == total and sum(auto.numel_per_rank) == total
    for name, blocks in auto.blocks.items():  # blocks tile the tensor in whole rows, each on another rank
        assert blocks[0].start == 0 and blocks[-1].stop == auto.numels[name]
        assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
        assert all(b.start % row == 0 for b in blocks) and len({b.rank for b in blocks}) == len(blocks)
    if whole.imbalance <= TARGET_IMBALANCE:
        assert auto == whole
    else:  # only rows can stop it from reaching the target
        assert max(auto.numel_per_rank) <= TARGET_IMBALANCE * total / world + row
        assert max(auto.numel_per_rank) <= max(whole.numel_per_rank)


@settings(max_examples=200, deadline=None)
@given(sizes, worlds, st.randoms(use_true_random=False))
def test_same_plan_whatever_the_input_order(numels, world, rnd):
    tensors = named(numels)
    shuffled = list(tensors)
    rnd.shuffle(shuffled)
    assert plan_ownership(tensors, world).blocks == plan_ownership(shuffled, world).blocks


def test_more_ranks_than_tensors_leaves_empty_sets():
    plan = plan_ownership([("a", 5), ("b", 3)], 4, split="never")
    assert sorted(plan.numel_per_rank) == [0, 0, 3, 5]
    assert [plan.names_of(r) for r in range(4)] == [["a"], ["b"], [], []]


def test_equal_sizes_tie_break_by_name_then_rank():
    plan = plan_ownership([("z", 4), ("a", 4), ("m", 4)], 2, split="never")
    assert dict(plan.owners) == {"a": 0, "m": 1, "z": 0}


def test_owner_accepts_the_parameter_itself():
    model = torch.nn.Linear(4, 3)
    names = {id(p): n for n, p in model.named_parameters()}
    plan = plan_ownership([(n, p.shape) for n, p in model.named_parameters()], 2, param_names=names, split="never")
    assert plan.owner(model.weight) == plan.owner("weight") == 0
    assert plan.owner(model.bias) == 1
    with pytest.raises(PlanError, match="not in this plan"):
        plan.owner(torch.nn.Parameter(torch.zeros(2)))
    split = plan_ownership([("big", (10, 4)), ("small", (4,))], 2, split="auto")
    with pytest.raises(ValueError, match="'big' is split into 2 blocks owned by ranks"):
        split.owner("big")
    assert [b.rank for b in split.blocks_of("big")] == [0, 1]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        plan_ownership([("a", 1)], 0)
    with pytest.raises(ValueError, match="unique"):
        plan_ownership([("a", 1), ("a", 2)], 2)
    with pytest.raises(ValueError, match="split must be"):
        plan_ownership([("a", 1)], 2, split="always")


def test_unsplittable_tensors_stay_whole():
    tensors = [("big", (10, 4)), ("small", (4,))]
    assert plan_ownership(tensors, 2, unsplittable={"big"}).blocks == plan_ownership(tensors, 2, split="never").blocks


@pytest.mark.parametrize("preset", ["gpt2-small", "llama2-7b", "llama3-8b"])
def test_presets_are_balanced_at_every_world_size_up_to_1024(preset):
    tensors = preset_shapes(preset)
    random.Random(0).shuffle(tensors)
    for world in (2, 4, 8, 16, 64, 256, 1024):
        auto = plan_ownership(tensors, world)
        never = plan_ownership(tensors, world, split="never")
        assert auto.imbalance <= TARGET_IMBALANCE, (preset, world, auto.imbalance)
        assert never.imbalance <= max(TARGET_IMBALANCE, never.imbalance_bound + 1e-9)
        if never.imbalance <= TARGET_IMBALANCE:
            assert not auto.split


def test_newton_schulz_work_is_balanced_first_and_elements_evened_out_around_it():
    from ds_tensorshard.datapath.inner_optimizer import newton_schulz_work

    matrices = [(f"m{i}", (64, 256)) for i in range(6)] + [(f"n{i}", (256, 256)) for i in range(3)]
    rest = [("embed", (1000, 64)), *[(f"v{i}", (64,)) for i in range(10)]]
    work = {name: newton_schulz_work(shape) for name, shape in matrices}
    plan = plan_ownership(matrices + rest, 3, unsplittable=set(work), work=work)
    assert all(len(plan.blocks[name]) == 1 for name in work)  # whole
    per_rank = [0.0] * 3
    for name, cost in work.items():
        per_rank[plan.blocks[name][0].rank] += cost
    assert list(plan.work_per_rank) == per_rank
    assert max(per_rank) <= max(max(work.values()), sum(work.values()) / 3) * 1.0001  # one 256x256 each
    assert plan.imbalance <= TARGET_IMBALANCE  # the embedding (split) evens the elements out
    assert newton_schulz_work((64, 256)) == 64 * 256 * 64 and newton_schulz_work((8, 2, 3)) == 8 * 6 * 6
