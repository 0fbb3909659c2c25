"""Buckets: owner-major, one dtype, bounded size, backward order; one collective per bucket."""
import deepspeed
import pytest
import torch

import ds_tensorshard.comm
from ds_tensorshard.buckets import build_buckets


def params(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]


def test_buckets_are_owner_major_single_dtype_bounded_and_in_backward_order():
    ps = params((10,), (20,), (5,), (30,), (7,)) + params((4,), dtype=torch.bfloat16)
    owner = {id(p): rank for p, rank in zip(ps, [0, 1, 0, 1, 0, 0])}
    buckets = build_buckets(ps, lambda p: owner[id(p)], bucket_numel=25)
    assert [b.owner for b in buckets] == sorted(b.owner for b in buckets)
    for b in buckets:
        assert all(owner[id(p)] == b.owner and p.dtype == b.dtype for p in b.params)
        assert b.numel <= 25 or len(b.params) == 1  # only a tensor larger than a bucket stands alone
        assert b.numel == sum(p.numel() for p in b.params)
    flat_order = [p for b in buckets if b.dtype == torch.float32 for p in b.params]
    assert flat_order == [ps[4], ps[2], ps[0], ps[3], ps[1]]  # reverse registration order within each owner
    assert sorted(id(p) for b in buckets for p in b.params) == sorted(id(p) for p in ps)


def test_pack_and_slices_roundtrip_with_missing_gradients():
    ps = params((2, 3), (4,))
    ps[0].grad = torch.arange(6.0).view(2, 3)
    (bucket,) = build_buckets(ps, lambda p: 0, bucket_numel=100)
    flat = bucket.pack(lambda p: p.grad)
    views = dict((id(p), v) for p, v in bucket.slices(flat))
    assert torch.equal(views[id(ps[0])], ps[0].grad)
    assert torch.equal(views[id(ps[1])], torch.zeros(4))


@pytest.mark.usefixtures("single_rank_world")
def test_one_collective_per_bucket_not_per_tensor(monkeypatch):
    calls = {"reduce": 0, "broadcast": 0}
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
    calls.update(reduce=0, broadcast=0)  # DeepSpeed broadcasts the model at initialize
    loss = engine(torch.randn(2, 8)).sum()
    engine.backward(loss)
    engine.step()
    assert calls == {"reduce": 3, "broadcast": 3}
