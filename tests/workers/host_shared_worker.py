"""Each collective of the shared-memory lane on real ranks, against the result computed here in the lane's
documented order (in rank order, whichever rank owns it), with a box
grown past its first size and two collectives started before either is waited for; one storage every rank maps,
and flat parameters laid in it; then which transport ``open_transport`` gives. Prints ``OK`` on success."""

import glob
import hashlib

import deepspeed
import torch

from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.flat_parameters import FlatParameters
from ds_tensorshard.datapath.flat_plan import plan_flat
from ds_tensorshard.errors import TensorShardUsageError
from ds_tensorshard.transports import host_shared, open_transport
from ds_tensorshard.transports.host_shared import FIRST_CAPACITY, HostSharedComm
from ds_tensorshard.transports.torch_comm import TorchComm

deepspeed.init_distributed(dist_backend="gloo")
cpu = torch.device("cpu")
comm = open_transport(TensorShardConfig(enabled=True, timeout_s=60.0), None, cpu)
assert isinstance(comm, HostSharedComm), comm.name
assert not comm.broadcasts_by_owner  # a bucket's spans in one exchange: an owner cannot send its own apart
rank, n = comm.rank, comm.world_size


def inputs(case: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input of this case (each rank makes all of them, to know the expected result)."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 * case + q)).to(dtype) for q in range(n)]


def owner_sum(xs: list[torch.Tensor], owner: int) -> torch.Tensor:
    """The sum in rank order, whichever rank owns it (an all-reduce's too)."""
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return total


def spans_of(numel: int) -> list[tuple[int, int, int]]:
    """(owner, offset, numel), back to back: rank 0 a fifth, the last rank the rest, any rank between none."""
    return [(0, 0, numel // 5), (n - 1, numel // 5, numel - numel // 5)]


def check(case: int, numel: int, dtype: torch.dtype) -> None:
    xs = inputs(case, numel, dtype)
    flat = xs[rank].clone()
    comm.start_reduce_segments(flat, spans_of(numel)).wait()
    for owner, offset, size in spans_of(numel):
        if owner == rank:
            assert torch.equal(flat[offset : offset + size], owner_sum(xs, owner)[offset : offset + size]), case
    flat = xs[rank].clone()
    comm.start_broadcast_segments(flat, spans_of(numel)).wait()
    for owner, offset, size in spans_of(numel):
        assert torch.equal(flat[offset : offset + size], xs[owner][offset : offset + size]), case
    slot = numel // n
    first, second = xs[rank][: slot * n].clone(), xs[rank][: slot * n].clone()
    reduced, gathered = comm.start_reduce_scatter(first, slot), comm.start_all_gather(second, slot)
    reduced.wait(), gathered.wait()
    mine = slice(rank * slot, (rank + 1) * slot)
    assert torch.equal(first[mine], owner_sum(xs, rank)[: slot * n][mine]), case
    assert torch.equal(second, torch.cat([x[q * slot : (q + 1) * slot] for q, x in enumerate(xs)])), case
    everyone = xs[rank].clone()
    comm.start_all_reduce(everyone).wait()
    expected = xs[0].clone()
    for x in xs[1:]:
        expected += x
    assert torch.equal(everyone, expected), case
    digest = hashlib.sha256(everyone.view(torch.uint8).numpy().tobytes()).digest()[:2]
    agreed = torch.tensor([float(int.from_bytes(digest, "big"))], dtype=torch.float64)
    comm.all_reduce_sum(agreed)
    assert agreed.item() == n * int.from_bytes(digest, "big"), "an all-reduce gave the ranks different bits"
    for owner in range(n):
        one = xs[rank].clone()
        comm.start_reduce(one, owner).wait()
        if owner == rank:
            assert torch.equal(one, owner_sum(xs, owner)), case
        one = xs[rank].clone()
        comm.start_broadcast(one, owner).wait()
        assert torch.equal(one, xs[owner]), case


check(0, 1000, torch.float32)
check(1, 999, torch.bfloat16)
check(2, FIRST_CAPACITY // 4 + 12345, torch.float32)  # past the first capacity: every box grows
assert comm.boxes.capacity > FIRST_CAPACITY
check(3, 1000, torch.float32)  # after the growth
comm._barrier()
assert not glob.glob(comm.boxes.prefix + "_*"), "a box's name was left in /dev/shm"
comm._barrier()  # every rank has looked before rank 0 makes the next name

# one storage every rank maps: what a rank writes in its slot, every rank reads after the next meeting
storage = comm.shared_storage(n * 1000 + 3, torch.float32)
assert not storage.any() and storage.numel() == n * 1000 + 3
comm._barrier()  # every rank has looked before any writes
storage[rank * 1000 : (rank + 1) * 1000] = rank + 1
comm.start_meet("the test's meeting").wait()
assert torch.equal(storage[: n * 1000], torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(1000))

# flat parameters laid there: rank 0's values laid once; each owner's change in its slot seen by every rank at the
# gather (a barrier, nothing copied); moved out of shared memory, the lane's all-gather brings the slots instead
torch.manual_seed(0)  # every rank the same values, as the engine's broadcast leaves them
params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(7, 5), (11,), (4, 4)]]
values = [p.detach().clone() for p in params]
names = {id(p): f"p{i}" for i, p in enumerate(params)}
plan = plan_flat([(names[id(p)], tuple(p.shape)) for p in params], n, names)
flat = FlatParameters(params, plan, comm)
assert flat.lane is comm and all(torch.equal(p.data, v) for p, v in zip(params, values))
comm._barrier()  # every rank has looked before any writes (as the step's norm all-reduce orders updates)
expected = torch.cat([v.view(-1) for v in values])
for moved in (False, True):
    if moved:
        flat.move(lambda t: t.clone())
        assert flat.lane is None
    mine = slice(rank * plan.flat_slot, (rank + 1) * plan.flat_slot)
    with torch.no_grad():
        flat.storage[mine] += 1.0
    flat.start_gather().wait()
    expected += 1.0
    assert torch.equal(torch.cat([p.data.view(-1) for p in params]), expected), (rank, moved)
    comm._barrier()  # every rank has looked before any writes again
if rank == n - 1:  # no room in /dev/shm on one rank for the storage: each rank keeps its own
    real_statvfs = host_shared.os.statvfs
    host_shared.os.statvfs = lambda path: type("Full", (), {"f_bavail": 0, "f_frsize": 4096})()
kept = FlatParameters(params, plan, comm)
if rank == n - 1:
    host_shared.os.statvfs = real_statvfs
assert kept.lane is None, kept.lane
assert torch.equal(torch.cat([p.data.view(-1) for p in params]), expected)
comm._barrier()
assert not glob.glob(comm.boxes.prefix + "_*"), "a shared storage's name was left in /dev/shm"

if rank == n - 1:  # no room in /dev/shm on one rank: every rank says so, naming the key, at the wait
    host_shared.os.posix_fallocate = lambda fd, offset, size: (_ for _ in ()).throw(OSError(28, "No space left"))
full = open_transport(TensorShardConfig(enabled=True, timeout_s=60.0), None, cpu)
pending = full.start_all_reduce(torch.ones(8))
try:
    pending.wait()
    raise AssertionError("a full /dev/shm went unnoticed")
except TensorShardUsageError as err:
    assert "'tensorshard.shared_memory': false" in str(err), err
full._barrier()  # every rank past its refusal
assert not glob.glob(full.boxes.prefix + "_*"), "a box's name was left in /dev/shm"

plain = open_transport(TensorShardConfig(enabled=True, shared_memory=False), None, cpu)
assert isinstance(plain, TorchComm), plain.name
if rank == n - 1:  # too little room in /dev/shm on one rank: no rank takes the lane
    real_statvfs = host_shared.os.statvfs
    host_shared.os.statvfs = lambda path: type("Small", (), {"f_bavail": 1, "f_frsize": 4096})()
assert not host_shared.on_one_host(plain)
if rank == n - 1:
    host_shared.os.statvfs = real_statvfs
assert host_shared.on_one_host(plain)
if rank == n - 1:  # one rank elsewhere: no rank takes the lane
    host_shared._host_key = lambda: "another host"
assert not host_shared.on_one_host(plain)
print("OK", flush=True)
