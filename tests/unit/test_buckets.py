"""Buckets: bounded windows of the gradient stream in backward order, grouped by owner, one dtype each;
one reduce and one broadcast per owner present in a bucket."""

import deepspeed
import pytest
import torch

import ds_tensorshard.transports.torch_comm
from ds_tensorshard.datapath.broadcast import start_gather
from ds_tensorshard.datapath.buckets import build_buckets, build_stripes
from ds_tensorshard.datapath.plan import Block, plan_ownership
from ds_tensorshard.transports.protocol import Pending


def params(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]


def whole(owners):
    return lambda p: (Block(owners[id(p)], 0, p.numel()),)


def test_worked_example_from_docstring():
    a, b, c = params((6,), (4,), (5,))
    blocks = {id(a): (Block(1, 0, 6),), id(b): (Block(0, 0, 4),), id(c): (Block(1, 0, 5),)}
    first, second = build_buckets([a, b, c], lambda p: blocks[id(p)], bucket_numel=8)
    layout = [
        [
            (s.owner, s.offset, [(p.param is x, p.start, p.stop) for p, x in zip(s.pieces, xs)])
            for s, xs in zip(bk.segments, parts)
        ]
        for bk, parts in ((first, [[b], [a]]), (second, [[b], [c]]))
    ]
    assert layout == [
        [(0, 0, [(True, 0, 2)]), (1, 2, [(True, 0, 6)])],
        [(0, 0, [(True, 2, 4)]), (1, 2, [(True, 0, 5)])],
    ]
    assert (first.numel, second.numel) == (8, 7)


def test_stripes_hold_a_slot_of_every_ranks_stream_padded_to_the_fullest():
    """a (6, rank 0), b (4, rank 1), c (5, rank 1), d (3, rank 0) in backward order, 2 ranks, bucket_numel 8:
    slot 4; rank 0's stream a d, rank 1's b c; the last bucket as wide as the fullest rank's rest (rank 0: 1,
    rank 1: 1)."""
    a, b, c, d = params((6,), (4,), (5,), (3,))
    owners = {id(a): 0, id(b): 1, id(c): 1, id(d): 0}
    buckets = build_stripes([a, b, c, d], whole(owners), bucket_numel=8, world_size=2)
    name = {id(a): "a", id(b): "b", id(c): "c", id(d): "d"}
    layout = [
        (
            bk.slot,
            bk.numel,
            [(s.owner, s.offset, [(name[id(p.param)], p.start, p.stop) for p in s.pieces]) for s in bk.segments],
        )
        for bk in buckets
    ]
    assert layout == [
        (4, 8, [(0, 0, [("a", 0, 4)]), (1, 4, [("b", 0, 4)])]),
        (4, 8, [(0, 0, [("a", 4, 6), ("d", 0, 2)]), (1, 4, [("c", 0, 4)])]),
        (1, 2, [(0, 0, [("d", 2, 3)]), (1, 1, [("c", 4, 5)])]),
    ]
    for x in (a, b, c, d):
        x.grad = torch.arange(1.0, x.numel() + 1)
    assert buckets[1].pack(lambda p: p.grad).tolist() == [5, 6, 1, 2, 1, 2, 3, 4]


def test_stripes_pad_a_rank_whose_stream_ran_out_with_zeros():
    a, b = params((10,), (2,))
    buckets = build_stripes([a, b], whole({id(a): 0, id(b): 1}), bucket_numel=8, world_size=2)
    assert [(bk.slot, [(s.owner, s.numel) for s in bk.segments]) for bk in buckets] == [
        (4, [(0, 4), (1, 2)]),
        (4, [(0, 4)]),
        (2, [(0, 2)]),
    ]
    a.grad, b.grad = torch.ones(10), torch.full((2,), 7.0)
    assert buckets[0].pack(lambda p: p.grad).tolist() == [1, 1, 1, 1, 7, 7, 0, 0]


def test_each_stripe_takes_the_routes_of_its_size_in_its_communication_dtype():
    a, b = params((10,), (2,))
    sizes = []
    routes = lambda nbytes: (sizes.append(nbytes) or nbytes < 32, nbytes < 16)  # noqa: E731
    buckets = build_stripes([a, b], whole({id(a): 0, id(b): 1}), 8, 2, lambda p: torch.bfloat16, routes)
    # stripes of 8, 8 and 4 bf16 elements: 16, 16 and 8 bytes
    assert sizes == [16, 16, 8]
    assert [bk.by_all_reduce for bk in buckets] == [(True, False), (True, False), (True, True)]
    assert build_stripes([a, b], whole({id(a): 0, id(b): 1}), 8, 2)[0].by_all_reduce == (False, False)


def test_buckets_are_bounded_windows_in_backward_order_grouped_by_owner_per_dtype():
    ps = params((10,), (20,), (5,), (30,), (7,), (6,)) + params((4,), dtype=torch.bfloat16)
    owners = {id(p): rank for p, rank in zip(ps, [0, 1, 0, 1, 0, 1, 0])}
    backward = list(reversed(ps))
    buckets = build_buckets(backward, whole(owners), bucket_numel=16)
    fp32 = [b for b in buckets if b.dtype == torch.float32]
    assert [b.numel for b in fp32] == [16, 16, 16, 16, 14] and len(buckets) == 6
    stream = []  # pieces in window order must retrace the backward order, each tensor tiled exactly
    for b in fp32:
        assert [s.owner for s in b.segments] == sorted({s.owner for s in b.segments})
        assert all(owners[id(p.param)] == s.owner and p.param.dtype == b.dtype for s in b.segments for p in s.pieces)
        assert [s.offset for s in b.segments] == [sum(x.numel for x in b.segments[:i]) for i in range(len(b.segments))]
        stream.append(sorted(b.pieces(), key=lambda p: ([id(q) for q in backward].index(id(p.param)), p.start)))
    flat = [(id(p.param), p.start, p.stop) for window in stream for p in window]
    merged = {}
    for key, start, stop in flat:
        assert merged.get(key, 0) == start
        merged[key] = stop
    assert merged == {id(p): p.numel() for p in ps if p.dtype == torch.float32}


def test_split_tensor_blocks_travel_to_their_owners():
    big, small = params((10, 4), (4,))
    plan = plan_ownership([("big", (10, 4)), ("small", (4,))], 2, param_names={id(big): "big", id(small): "small"})
    buckets = build_buckets([small, big], plan.blocks_of, bucket_numel=16)
    assert max(b.numel for b in buckets) == 16 and sum(b.numel for b in buckets) == 44
    for b in buckets:
        for s in b.segments:
            for p in s.pieces:
                block = next(x for x in plan.blocks_of(p.param) if x.start <= p.start < x.stop)
                assert block.rank == s.owner and p.stop <= block.stop


def test_pack_and_views_roundtrip_with_missing_gradients():
    ps = params((2, 3), (4,), (5,))
    ps[0].grad = torch.arange(6.0).view(2, 3)
    ps[2].grad = torch.full((5,), 7.0)
    owners = {id(ps[0]): 1, id(ps[1]): 1, id(ps[2]): 0}
    (bucket,) = build_buckets(ps, whole(owners), bucket_numel=100)
    assert [(s.owner, s.offset, s.numel) for s in bucket.segments] == [(0, 0, 5), (1, 5, 10)]
    flat = bucket.pack(lambda p: p.grad)
    assert torch.equal(flat[:5], torch.full((5,), 7.0))
    views = {id(piece.param): v for piece, v in bucket.segment_of(1).views(flat[5:])}
    assert torch.equal(views[id(ps[0])], ps[0].grad.view(-1))
    assert torch.equal(views[id(ps[1])], torch.zeros(4))


@pytest.mark.usefixtures("single_rank_world")
def test_one_reduce_per_owner_in_a_bucket_not_per_tensor_and_no_broadcast_at_one_rank(monkeypatch):
    calls = {"reduce": 0, "broadcast": 0}
    for name in calls:
        original = getattr(ds_tensorshard.transports.torch_comm.dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ds_tensorshard.transports.torch_comm.dist, name, counted)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])  # 12 tensors, 432 elements
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True, "bucket_numel": 150},
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert [b.numel for b in optimizer.buckets] == [150, 150, 132]
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # the first backward also agrees on the order gradients arrive in (one broadcast)
        calls.update(reduce=0, broadcast=0)
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    # the one rank owns every tensor and updates it in place: nothing to broadcast, the model updated all the same
    assert calls == {"reduce": 3, "broadcast": 0}
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.usefixtures("single_rank_world")
def test_reduction_starts_from_gradient_hooks_while_backward_runs():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True, "bucket_numel": 150},
    }
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
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True},
    }
    _, first, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine, second, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    assert first.reducer.ready == [0] * len(first.buckets)  # the first engine's hooks are gone
    engine.step()
    assert len(second.optimizer.state) == 4 and len(first.optimizer.state) == 0


class LateRegistered(torch.nn.Module):
    """Six layers, then a layer registered after them but used first (its gradients are final last) and
    one never used: reverse registration order is not backward's order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        self.embed = torch.nn.Linear(8, 8, bias=False)
        self.unused = torch.nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embed(x)).sum()


@pytest.mark.usefixtures("single_rank_world")
def test_buckets_follow_the_order_backward_produced_after_the_first_step():
    model = LateRegistered()
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True, "bucket_numel": 150},
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert optimizer.buckets[0].params[:2] == (model.unused.weight, model.embed.weight)  # reverse registration
    seen = []
    x = torch.randn(2, 8, requires_grad=True)
    x.register_hook(lambda grad: seen.append(optimizer.reducer.started))  # the very end of backward
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    last = optimizer.buckets[-1].params
    assert last[-2] is model.embed.weight and last[-1] is model.unused.weight  # produced last; never produced
    assert seen[0] == 0  # first backward: the unused parameter held every bucket back
    waiting = sum(any(p is model.embed.weight for p in b.params) for b in optimizer.buckets)
    assert waiting == 2 and seen[1] == len(optimizer.buckets) - waiting  # afterwards only the embedding's wait


def test_a_stripe_gathered_by_all_reduce_keeps_every_value_bit_for_bit():
    # each rank's buffer holds its slot and -0.0 elsewhere; their sum is every owner's values, zero signs included
    a, b = params((4,), (4,))
    a.data = torch.tensor([-0.0, 1.5, -2.0, 0.0])
    b.data = torch.tensor([0.0, -0.0, 3.0, -1e-30])
    (stripe,) = build_stripes([a, b], whole({id(a): 0, id(b): 1}), 8, 2, routes=lambda nbytes: (True, True))
    sent = []

    class Rank:
        def __init__(self, rank):
            self.rank = rank

        def start_all_reduce(self, flat):
            sent.append(flat)
            return Pending(lambda: None)

    for rank in (0, 1):
        start_gather(stripe, Rank(rank))
    assert sent[0][4:].tolist() == sent[1][:4].tolist() == [-0.0] * 4
    summed = sent[0] + sent[1]
    assert torch.equal(summed.view(torch.int32), torch.cat([a.data, b.data]).view(torch.int32))
    # with +0.0 the first of them would lose its sign
    assert not torch.equal((a.data + torch.zeros(4)).view(torch.int32), a.data.view(torch.int32))


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16])
def test_pack_divides_into_the_bucket_as_a_division_after_the_concatenation_would(comm_dtype):
    # each gradient divided into its place (same dtype) or concatenated then divided (a cast on the way): the same
    # quotients bit for bit, a missing gradient zeros
    ps = params((3, 5), (7,), (4,))
    generator = torch.Generator().manual_seed(0)
    ps[0].grad, ps[2].grad = torch.randn(3, 5, generator=generator), torch.randn(4, generator=generator)
    (bucket,) = build_buckets(ps, whole({id(ps[0]): 0, id(ps[1]): 1, id(ps[2]): 0}), bucket_numel=100)
    reference = bucket.pack(lambda p: p.grad, comm_dtype).div_(3.0)
    packed = bucket.pack(lambda p: p.grad, comm_dtype, divisor=3.0)
    assert packed.dtype == reference.dtype and torch.equal(
        packed.view(torch.int16 if comm_dtype else torch.int32),
        reference.view(torch.int16 if comm_dtype else torch.int32),
    )
