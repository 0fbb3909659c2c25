"""Flat parameters (``bucket_layout: "flat"``): the flat plan, the storage the parameters become views of, and when
a run takes it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.defaults import DEFAULT_BUCKET_NUMEL, FLAT_SHARED_WHY, FLAT_WHY, Wire, choose_layout
from ds_tensorshard.datapath.flat_choice import flat_refusal, lays_flat
from ds_tensorshard.datapath.flat_parameters import FlatParameters
from ds_tensorshard.datapath.flat_plan import plan_flat
from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.errors import TensorShardConfigError
from ds_tensorshard.examples.host_cost import InstantComm
from tests.unit.test_config import base_config, initialize


def test_the_worked_example():
    plan = plan_flat([("a", 6), ("b", (4,)), ("c", 3), ("d", 3)], 2)
    assert plan.flat_slot == 8 and plan.flat_offsets == {"a": 0, "b": 6, "c": 10, "d": 13}
    assert plan.blocks["b"] == (Block(0, 0, 2), Block(1, 2, 4)) and plan.split == {"b": 2}
    assert plan.numel_per_rank == (8, 8) and plan.owner("c") == plan.owner("d") == 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64])
def test_each_rank_owns_its_slot_of_the_tensors_laid_end_to_end(world_size):
    rng = random.Random(world_size)
    shapes = [(f"t{i}", (rng.randint(1, 40), rng.randint(1, 9))) for i in range(50)]
    plan = plan_flat(shapes, world_size)
    total, slot = sum(math.prod(s) for _, s in shapes), plan.flat_slot
    share = -(-total // world_size)  # rounded up to whole 2-element (4-byte) units, as stock's partitions
    assert slot % 2 == 0 and share <= slot < share + 2 and sum(plan.numel_per_rank) == total
    position = 0
    for name, shape in shapes:  # model order, back to back: every tensor one contiguous range
        assert plan.flat_offsets[name] == position
        blocks = plan.blocks[name]
        assert blocks[0].start == 0 and all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
        assert blocks[-1].stop == math.prod(shape) and len({b.rank for b in blocks}) == len(blocks)
        for block in blocks:  # inside its owner's slot
            assert block.rank * slot <= position + block.start and position + block.stop <= (block.rank + 1) * slot
        position += math.prod(shape)
    assert len(plan.split) <= world_size - 1 and all(load <= slot for load in plan.numel_per_rank)


def _model_params(dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.nn.Parameter], list[torch.Tensor]]:
    torch.manual_seed(0)
    params = {name: torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for name, shape in [("w", (3, 4)), ("b", (5,))]}
    return params, [p.detach().clone() for p in params.values()]


def test_the_parameters_become_views_of_one_storage_with_their_values():
    params, before = _model_params()
    plan = plan_flat([(n, tuple(p.shape)) for n, p in params.items()], 2, {id(p): n for n, p in params.items()})
    flat = FlatParameters(list(params.values()), plan, InstantComm(2))
    assert flat.storage.numel() == 2 * plan.flat_slot == 20 and not flat.storage[17:].any()  # 17 elements, 10 a slot
    base = flat.storage.data_ptr()
    for (name, param), value in zip(params.items(), before):
        assert param.data_ptr() == base + plan.flat_offsets[name] * 4 and torch.equal(param.data, value)
    flat.move(lambda t: t.clone())  # offload_states: the storage moves, the parameters follow it
    assert params["b"].data_ptr() == flat.storage.data_ptr() + 12 * 4 and torch.equal(params["b"].data, before[1])


def test_a_gather_by_all_reduce_leaves_minus_zero_in_the_other_slots():
    params, before = _model_params()
    plan = plan_flat([(n, tuple(p.shape)) for n, p in params.items()], 2, {id(p): n for n, p in params.items()})
    flat = FlatParameters(list(params.values()), plan, InstantComm(2))
    flat.by_all_reduce = True
    flat.start_gather().wait()  # moves nothing: rank 0's slot kept, rank 1's -0.0 (what the sum adds to)
    assert torch.equal(flat.storage[:10], torch.cat([before[0].view(-1), before[1]])[:10])  # w[0:10] is rank 0's
    assert torch.equal(flat.storage[10:].abs(), torch.zeros(10)) and bool(torch.signbit(flat.storage[10:]).all())


def test_auto_lays_flat_on_accelerators_and_shared_memory_only_where_nothing_rules_it_out():
    auto, flat = TensorShardConfig(), TensorShardConfig(bucket_layout="flat")
    assert lays_flat(auto, on_cpu=False, world_size=8, refusal=None)
    assert not lays_flat(auto, on_cpu=True, world_size=8, refusal=None)  # CPU ranks: the layouts measured there
    assert lays_flat(auto, on_cpu=True, world_size=2, refusal=None, shared_memory=True)  # one storage they share
    assert not lays_flat(auto, on_cpu=True, world_size=2, refusal="ZeRO-Offload", shared_memory=True)
    assert not lays_flat(auto, on_cpu=False, world_size=1, refusal=None)
    assert not lays_flat(auto, on_cpu=False, world_size=8, refusal="ZeRO-Offload")
    assert not lays_flat(TensorShardConfig(bucket_layout="stripes"), on_cpu=False, world_size=8, refusal=None)
    assert lays_flat(flat, on_cpu=True, world_size=2, refusal=None)
    with pytest.raises(TensorShardConfigError, match="'flat' with ZeRO-Offload is not supported"):
        lays_flat(flat, on_cpu=False, world_size=8, refusal="ZeRO-Offload")


def test_flat_asked_for_with_what_rules_it_out_is_refused_at_initialize():
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    config = base_config(zero_optimization=offload, tensorshard={"enabled": True, "bucket_layout": "flat"})
    with pytest.raises(TensorShardConfigError, match=r"'flat' with ZeRO-Offload \(zero_optimization.offload_optimi"):
        initialize(config)
    never = {"enabled": True, "bucket_layout": "flat", "split_tensors": "never"}
    with pytest.raises(TensorShardConfigError, match="'flat' with 'tensorshard.split_tensors': 'never'"):
        initialize(base_config(tensorshard=never))


def test_flat_at_one_rank_trains_with_the_parameters_in_its_storage():
    model, engine, opt = initialize(base_config(tensorshard={"enabled": True, "bucket_layout": "flat"}))
    assert opt.layout.layout == "flat" and "flat parameter storage gathered in place" in opt.layout.why
    storage = opt.domains["data_parallel"].flat.storage
    before = [p.detach().clone() for p in model.parameters()]
    loss = engine(torch.randn(2, 4)).square().sum()
    engine.backward(loss)
    engine.step()
    for param, old in zip(model.parameters(), before):
        assert storage.data_ptr() <= param.data_ptr() < storage.data_ptr() + storage.numel() * 4
        assert not torch.equal(param.detach(), old)


def test_flat_takes_the_cost_models_bucket_on_accelerators_and_the_measured_one_on_cpu_ranks():
    numels, owned = [6 * 10**6] * 64, [48 * 10**6] * 8
    accelerator = Wire("torch", "torch (nccl)", on_cpu=False)
    chosen = choose_layout(TensorShardConfig(), {}, accelerator, numels, owned, 2, 8 * 48 * 10**6)
    assert chosen.layout == "flat" and chosen.why.startswith(FLAT_WHY) and "stripes, " in chosen.why
    assert chosen.bucket_numel == 8 * -(-48 * 10**6 // -(-48 * 10**6 // (chosen.bucket_numel // 8)))
    asked = TensorShardConfig(bucket_layout="flat")
    on_cpu = choose_layout(asked, {}, Wire("torch", "torch (gloo)", on_cpu=True), numels, owned, 4, 8 * 48 * 10**6)
    assert (on_cpu.layout, on_cpu.bucket_numel) == ("flat", DEFAULT_BUCKET_NUMEL)
    assert on_cpu.why.startswith("bucket_layout set in the config") and "gathered in place by all-gather" in on_cpu.why


class _Engine:
    """What flat_refusal reads of an engine."""

    def __init__(self, offload: bool = False, mpu: object | None = None) -> None:
        self.offload, self.mpu = offload, mpu

    def zero_cpu_offload(self) -> bool:
        return self.offload


def test_each_thing_that_rules_flat_out_is_named():
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))]
    adam, plain = torch.optim.AdamW(params), _Engine()

    def refusal(engine=plain, optimizer=adam, tensors=params, experts=False, joint=False, split="auto"):
        return flat_refusal(engine, optimizer, tensors, experts, joint, split)

    assert refusal() is None
    assert refusal(joint=True).startswith("initialize_many")
    assert refusal(_Engine(offload=True)).startswith("ZeRO-Offload")
    assert refusal(experts=True).startswith("a mixture-of-experts model")
    assert refusal(optimizer=torch.optim.LBFGS(params)) == "the LBFGS optimizer, which updates whole matrices"
    assert refusal(split="never") == "'tensorshard.split_tensors': 'never'"
    assert refusal(_Engine(mpu=object())).startswith("pipeline or tensor parallelism")
    mixed = [params[0], torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    assert refusal(optimizer=torch.optim.AdamW(mixed), tensors=mixed).startswith("trained parameters of more than one")


def test_flat_through_shared_memory_reduces_by_reduce_scatter_and_shares_the_storage():
    numels, owned = [6 * 10**6] * 4, [12 * 10**6] * 2
    lane = Wire("torch", "torch (gloo) + shared memory", on_cpu=True, shared_memory=True)
    chosen = choose_layout(TensorShardConfig(), {}, lane, numels, owned, 4, 24 * 10**6)
    assert (chosen.layout, chosen.bucket_numel) == ("flat", DEFAULT_BUCKET_NUMEL)
    assert chosen.why.startswith(FLAT_SHARED_WHY) and chosen.why.endswith("shared (its gather a barrier)")
    assert chosen.routes(2).of(10**9) == (False, False)  # gloo alone all-reduces stripes at 2 ranks
    gloo = Wire("torch", "torch (gloo)", on_cpu=True)
    assert choose_layout(TensorShardConfig(bucket_layout="stripes"), {}, gloo, numels, owned, 4).routes(2).of(1)[0]
