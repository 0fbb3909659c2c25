"""Buckets: owner-major segments, one dtype, bounded size, backward order; one collective per bucket."""
import deepspeed
import pytest
import torch

import ds_tensorshard.comm
from ds_tensorshard.buckets import build_buckets


def params(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]


def test_buckets_are_owner_major_single_dtype_balanced_and_in_backward_order():
    ps = params((10,), (20,), (5,), (30,), (7,), (6,)) + params((4,), dtype=torch.bfloat16)
    owner = {id(p): rank for p, rank in zip(ps, [0, 1, 0, 1, 0, 1, 0])}
    buckets = build_buckets(ps, lambda p: owner[id(p)], world_size=2, bucket_numel=40)
    for b in buckets:
        for rank, segment in enumerate(b.segments):
            assert all(owner[id(p)] == rank and p.dtype == b.dtype for p in segment)
        # a segment stops at the tensor that brings it closest to bucket_numel / world_size (20 here)
        assert all(count - segment[-1].numel() < 20 for count, segment in zip(b.counts, b.segments) if segment)
        assert b.counts == tuple(sum(p.numel() for p in s) for s in b.segments)
    fp32 = [b for b in buckets if b.dtype == torch.float32]
    # each rank's queue is consumed in backward order: rank 0 = [7, 5, 10], rank 1 = [6, 30, 20]
    assert [[[p.numel() for p in s] for s in b.segments] for b in fp32] == [[[7, 5, 10], [6]], [[], [30]], [[], [20]]]
    assert sorted(id(p) for b in buckets for s in b.segments for p in s) == sorted(id(p) for p in ps)


def test_pack_and_views_roundtrip_with_missing_gradients():
    ps = params((2, 3), (4,), (5,))
    ps[0].grad = torch.arange(6.0).view(2, 3)
    ps[2].grad = torch.full((5,), 7.0)
    owner = {id(ps[0]): 1, id(ps[1]): 1, id(ps[2]): 0}
    (bucket,) = build_buckets(ps, lambda p: owner[id(p)], world_size=2, bucket_numel=100)
    assert bucket.counts == (5, 10)
    flat = bucket.pack(lambda p: p.grad, starts=[0, 12], total=22)  # a gap of padding between segments
    assert torch.equal(flat[:5], torch.full((5,), 7.0)) and torch.equal(flat[5:12], torch.zeros(7))
    views = {id(p): v for p, v in bucket.views(1, flat[12:])}
    assert torch.equal(views[id(ps[0])], ps[0].grad)
    assert torch.equal(views[id(ps[1])], torch.zeros(4))


@pytest.mark.usefixtures("single_rank_world")
def test_one_collective_per_bucket_not_per_tensor(monkeypatch):
    calls = {"reduce_scatter_tensor": 0, "all_gather_into_tensor": 0}
    for name in calls:
        original = getattr(ds_tensorshard.comm.dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(ds_tensorshard.comm.dist, name, counted)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])  # 12 tensors, 432 elements
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "tensorshard": {"enabled": True, "bucket_numel": 150}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert len(optimizer.buckets) == 3
    calls.update(reduce_scatter_tensor=0, all_gather_into_tensor=0)
    loss = engine(torch.randn(2, 8)).sum()
    engine.backward(loss)
    engine.step()
    assert calls == {"reduce_scatter_tensor": 3, "all_gather_into_tensor": 3}


@pytest.mark.usefixtures("single_rank_world")
def test_reduction_starts_from_gradient_hooks_while_backward_runs():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "tensorshard": {"enabled": True, "bucket_numel": 150}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seen = []
    x = torch.randn(2, 8, requires_grad=True)
    x.register_hook(lambda grad: seen.append(optimizer.reducer.started))  # runs at the very end of backward
    engine.backward(engine(x).sum())
    assert seen == [2]  # the buckets of the last layers were already under way; the first one needs layer 0's grads
    assert optimizer.reducer.started == 0 and not optimizer.reducer.in_flight  # all finished and reset
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.usefixtures("single_rank_world")
def test_a_model_given_to_a_new_engine_reduces_only_there():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "tensorshard": {"enabled": True}}
    _, first, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine, second, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    assert first.reducer.ready == [0] * len(first.buckets)  # the first engine's hooks are gone
    engine.step()
    assert len(second.optimizer.state) == 4 and len(first.optimizer.state) == 0
