"""Unit tests of the data path's modules in one process: reduce, update, gather, the transports and the
checkpoint files, each against a transport that plays the other rank (no processes, no network)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from ds_tensorshard.checkpoints.files import load, save_atomic, verify
from ds_tensorshard.datapath.broadcast import broadcast_buckets
from ds_tensorshard.datapath.buckets import build_buckets
from ds_tensorshard.datapath.plan import Block, plan_ownership
from ds_tensorshard.datapath.reduce import Averaging, OverlappedReducer, autocast_comm_dtypes, start_reduce
from ds_tensorshard.datapath.update import OwnedShard
from ds_tensorshard.errors import CheckpointError, CollectiveTimeout
from ds_tensorshard.transports.deadline import wait_with_deadline
from ds_tensorshard.transports.protocol import Pending, all_of


class PeerComm:
    """Rank ``rank`` of two; the other rank's contribution to every reduce is ``peer_factor`` times ours, and
    what the other rank broadcasts is ``broadcast_value`` everywhere."""

    world_size, global_ranks, timeout_s, name, device = 2, [0, 1], 1.0, "peer", torch.device("cpu")
    broadcasts_by_owner = True

    def __init__(self, rank: int = 0, peer_factor: float = 3.0, broadcast_value: float = -1.0) -> None:
        self.rank, self.peer_factor, self.broadcast_value = rank, peer_factor, broadcast_value
        self.calls: list[tuple[str, int, int]] = []

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        self.calls.append(("reduce", owner, tensor.numel()))
        if owner == self.rank:
            tensor.mul_(1.0 + self.peer_factor)
        return Pending(lambda: None)

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        self.calls.append(("broadcast", owner, tensor.numel()))
        if owner != self.rank:
            tensor.fill_(self.broadcast_value)
        return Pending(lambda: None)

    def start_reduce_segments(self, flat: torch.Tensor, spans) -> Pending:
        return all_of([self.start_reduce(flat[offset : offset + numel], owner) for owner, offset, numel in spans])

    def start_broadcast_segments(self, flat: torch.Tensor, spans) -> Pending:
        return all_of([self.start_broadcast(flat[offset : offset + numel], owner) for owner, offset, numel in spans])

    def all_reduce_sum(self, tensor: torch.Tensor, where=None) -> None:
        tensor.mul_(1.0 + self.peer_factor)

    def fail(self, message: str):
        raise CollectiveTimeout(message)


def params(*shapes):
    return [torch.nn.Parameter(torch.arange(float(torch.Size(s).numel())).view(s)) for s in shapes]


def test_reduce_averages_like_deepspeed_and_hands_this_rank_its_pieces():
    a, b = params((2, 3), (4,))
    owners = {id(a): 0, id(b): 1}
    (bucket,) = build_buckets([b, a], lambda p: (Block(owners[id(p)], 0, p.numel()),), bucket_numel=100)
    a.grad, b.grad = torch.ones(2, 3), torch.full((4,), 2.0)
    comm = PeerComm(rank=0, peer_factor=3.0)
    segment = start_reduce(bucket, comm, Averaging(divide_before=2.0), lambda p: p.grad).wait()
    assert torch.allclose(segment, torch.full((6,), (1 + 3) / 2))  # (ours + the peer's) / 2, a's only
    assert [c[:2] for c in comm.calls] == [("reduce", 0), ("reduce", 1)]  # one reduce per owner present
    after = start_reduce(bucket, comm, Averaging(scale_before=0.5, scale_after=2.0 / 2), lambda p: p.grad).wait()
    assert torch.allclose(after, torch.full((6,), 0.5 * 4 * 1.0))


def test_tensors_deepspeed_autocast_marked_travel_in_the_marked_dtype(monkeypatch):
    a, b = params((3,), (4,))
    assert autocast_comm_dtypes()(a) is None  # no autocast engine in this process: the config's dtype
    monkeypatch.setattr("deepspeed.runtime.torch_autocast.TORCH_AUTOCAST_INITIALIZED", True)
    a.comm_dtype = torch.bfloat16  # DeepSpeed's mark (init_autocast_params) on a Linear weight
    comm_dtype_of = autocast_comm_dtypes()
    assert (comm_dtype_of(a), comm_dtype_of(b)) == (torch.bfloat16, torch.float32)  # unmarked: its own dtype
    whole = lambda p: (Block(0, 0, p.numel()),)  # noqa: E731
    buckets = build_buckets([b, a], whole, bucket_numel=100, comm_dtype_of=comm_dtype_of)
    assert [(bk.dtype, bk.comm_dtype, bk.params) for bk in buckets] == [
        (torch.float32, torch.float32, (b,)),
        (torch.float32, torch.bfloat16, (a,)),
    ]
    a.grad, b.grad = torch.full((3,), 1 + 2**-10), torch.full((4,), 1 + 2**-10)  # 1 + 2^-10 is 1 in bf16
    averaging = Averaging(divide_before=2.0, comm_dtype=torch.float64)  # the config's: not used once marked
    summed = [start_reduce(bk, PeerComm(peer_factor=1.0), averaging, lambda p: p.grad).wait() for bk in buckets]
    assert [s.dtype for s in summed] == [torch.float32, torch.float32]  # back in the gradients' dtype
    assert torch.equal(summed[0], b.grad) and torch.equal(summed[1], torch.ones(3))


def test_reducer_starts_buckets_in_order_as_gradients_become_final_and_releases_them():
    ps = params((10,), (10,), (10,))
    plan = plan_ownership(
        [(f"p{i}", (10,)) for i in range(3)], 2, split="never", param_names={id(p): f"p{i}" for i, p in enumerate(ps)}
    )
    backward = list(reversed(ps))
    buckets = build_buckets(backward, plan.blocks_of, bucket_numel=10)
    delivered = []
    reducer = OverlappedReducer(
        buckets,
        PeerComm(),
        Averaging(),
        lambda b, s: delivered.append(s.clone()),
        ps,
        lambda p: "p",
        lambda order: build_buckets(order, plan.blocks_of, 10),
    )
    for p in ps:
        p.grad = torch.ones(10)
    reducer.gradient_ready(ps[0])  # produced out of backward order: its bucket is the last, nothing starts
    assert reducer.started == 0 and ps[0].grad is not None
    reducer.gradient_ready(ps[2])
    reducer.gradient_ready(ps[1])
    assert reducer.started == 3 and all(p.grad is None for p in ps)  # packed and released
    with pytest.raises(RuntimeError, match="delivered twice"):
        reducer.gradient_ready(ps[1])
    reducer.finish()
    assert len(delivered) == sum(1 for b in buckets if b.segment_of(0) is not None)
    assert [b.params[0] for b in reducer.buckets] == [ps[0], ps[2], ps[1]]  # rebuilt in the order seen


def test_owned_shard_accumulates_segments_clips_steps_and_writes_back():
    (w,) = params((4, 2))
    optimizer = torch.optim.SGD([w], lr=1.0)
    shard = OwnedShard(optimizer, [[(w, Block(0, 2, 6))]], torch.float32, torch.device("cpu"))  # rows 1-2
    master = shard.masters[w]
    assert master.shape == (2, 2) and master.data_ptr() == w.data_ptr() + 2 * 4  # a view: no second copy
    from ds_tensorshard.datapath.buckets import Piece, Segment

    first, second = Segment(0, 0, 2, (Piece(w, 2, 4),)), Segment(0, 0, 2, (Piece(w, 4, 6),))
    shard.grads.accept(first, torch.ones(2))
    shard.grads.accept(second, torch.full((2,), 3.0))
    shard.grads.accept(first, torch.ones(2))  # a second micro-step
    shard.gradients_to_masters()
    assert master.grad is shard.step_gradient(w)  # bound once: the gradient buffer's view
    assert torch.equal(master.grad, torch.tensor([[2.0, 2.0], [3.0, 3.0]]))
    assert float(shard.squared_grad_norms()[0]) == 4 + 4 + 9 + 9
    before = w.detach().clone()
    shard.step()
    assert torch.equal(w[1:3], (before[1:3] - master.grad)) and torch.equal(w[0], before[0])
    shard.drop_grads()
    assert torch.equal(master.grad, torch.zeros(2, 2))  # the next step accumulates from zero


def test_held_gradients_keep_the_last_clipped_one_and_stay_out_of_the_norm():
    """Stage 3 with ZeRO-Offload: a held tensor keeps its step gradient as the last step left it (clipped), is
    clipped again, and its squares are left out; the others take their new gradient."""
    from ds_tensorshard.datapath.buckets import Piece, Segment
    from ds_tensorshard.datapath.host import HostMemory

    a, b, c = params((2,), (3,), (2,))
    optimizer = torch.optim.SGD([a, b, c], lr=1.0)
    blocks = [(a, Block(0, 0, 2)), (b, Block(0, 0, 3)), (c, Block(0, 0, 2))]
    shard = OwnedShard(optimizer, [blocks], torch.float32, torch.device("cpu"), HostMemory(False), keeps=True)
    segments = {p: Segment(0, 0, p.numel(), (Piece(p, 0, p.numel()),)) for p in (a, b, c)}

    def backward(values: dict) -> None:
        for param, value in values.items():
            shard.grads.restart(segments[param], lambda _: True)
            shard.grads.accept(segments[param], torch.full((param.numel(),), value))

    backward({a: 1.0, b: 2.0, c: 3.0})
    shard.gradients_to_masters()
    assert float(shard.squared_grad_norms()[0]) == 2 + 12 + 18
    shard.scale_grads(0.5)
    shard.step()
    shard.drop_grads()
    backward({a: 4.0, c: 5.0})  # b sits out
    shard.grads.hold([b])
    shard.gradients_to_masters()
    assert torch.equal(shard.step_gradient(b), torch.full((3,), 1.0))  # its last, clipped
    assert float(shard.squared_grad_norms()[0]) == 32 + 50  # b left out
    shard.scale_grads(0.5)
    assert torch.equal(shard.step_gradient(b), torch.full((3,), 0.5))  # clipped again
    assert torch.equal(shard.step_gradient(c), torch.full((2,), 2.5))
    shard.grads.hold([])
    shard.gradients_to_masters()
    assert torch.equal(shard.step_gradient(b), torch.full((3,), 2.0))  # not held: its kept (raw) gradient


def test_gather_writes_the_other_owners_pieces_and_sends_its_own():
    a, b = params((3,), (5,))
    owners = {id(a): 0, id(b): 1}
    buckets = build_buckets([a, b], lambda p: (Block(owners[id(p)], 0, p.numel()),), bucket_numel=4)
    comm = PeerComm(rank=0, broadcast_value=-1.0)
    ours = a.detach().clone()
    broadcast_buckets(buckets, comm)
    assert torch.equal(a.detach(), ours) and torch.equal(b.detach(), torch.full((5,), -1.0))
    assert sum(n for kind, owner, n in comm.calls if kind == "broadcast") == 8


@pytest.mark.usefixtures("single_rank_world")
def test_torch_transport_at_one_rank_and_its_deadline():
    from ds_tensorshard.transports.torch_comm import TorchComm

    comm = TorchComm(None, timeout_s=5.0, device=torch.device("cpu"))
    t = torch.arange(4.0)
    comm.start_reduce(t, 0).wait()
    comm.start_broadcast(t, 0).wait()
    comm.all_reduce_sum(t)
    assert torch.equal(t, torch.arange(4.0)) and comm.name == "torch (gloo)"
    assert not wait_with_deadline(lambda: False, 0.05) and wait_with_deadline(lambda: True, 0.05)


def test_checkpoint_files_are_atomic_verified_and_refuse_code(tmp_path):
    path = str(tmp_path / "f.pt")
    save_atomic({"x": torch.ones(3), "n": 3}, path)
    verify(path)
    assert load(path)["n"] == 3
    assert sorted(os.listdir(tmp_path)) == [".f.pt.sha256", "f.pt"]  # no temporary file left
    with open(path, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        verify(path)

    class Payload:
        def __reduce__(self):
            return print, ("ran",)

    torch.save({"p": Payload()}, path)
    with pytest.raises(CheckpointError, match="refers to .*print"):
        load(path)
    with open(path, "wb") as f:
        pickle.dump([1], f)
    with pytest.raises(CheckpointError, match="cannot read checkpoint file"):
        load(path)


def test_digest_side_files_stay_out_of_deepspeeds_file_lists_and_old_ones_are_still_checked(tmp_path):
    from deepspeed.checkpoint.reshape_utils import get_files, get_files_with_prefix

    folder = tmp_path / "tag"
    folder.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        save_atomic({"x": torch.ones(2)}, str(folder / name))
    # ds_to_universal takes every file whose name starts so for a checkpoint file
    found = get_files(str(folder))
    assert [os.path.basename(f) for f in get_files_with_prefix(found, "mp_rank_")] == ["mp_rank_00_model_states.pt"]
    assert len(get_files_with_prefix(found, "zero_pp_rank_")) == 1
    old = str(tmp_path / "old.pt")  # an earlier ds_tensorshard's naming: <file>.sha256
    torch.save({"x": torch.ones(2)}, old)
    with open(old + ".sha256", "w") as f:
        f.write("0" * 64)
    with pytest.raises(CheckpointError, match=r"old.pt is truncated or corrupt .*old.pt.sha256"):
        verify(old)
