"""Ranks on one host, tensors on the CPU: the data path's collectives through shared memory
(``tensorshard.shared_memory``, on by default).

Each rank maps one /dev/shm segment per rank of the group (its box). A collective writes this rank's part into its
own box, meets every rank at a barrier (the inner transport's one-element all-reduce, with its deadline), then reads
the others' parts from their boxes: one copy in and one out, where gloo moves every byte through the kernel's loopback
twice (and reduce-scatters by all-reducing). Each collective completes before it returns. A box has two halves used
in turn, so one barrier per collective suffices: a rank writes a half again only after every rank has passed a later
barrier, that is, has finished reading it. Sums run in rank order, so an all-reduce gives every rank the same bits
and a reduction the same bits whichever rank owns it.

:func:`on_one_host` decides, the same way on every rank, whether the lane is taken: every rank of the group on this
host (the same boot, network namespace and /dev/shm) with /dev/shm writable and room there for every rank's first
box (a container's small /dev/shm keeps the transport); otherwise the inner transport alone.
The boxes are reserved when made (at the first collective, and where a larger one grows them): a /dev/shm without
room for them is refused on every rank, naming the key to turn the lane off.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import socket
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from ds_tensorshard.errors import CollectiveTimeout, TensorShardUsageError
from ds_tensorshard.transports.protocol import Pending, Span, Transport

SHM_DIR = "/dev/shm"
ALIGN = 4096  # bytes: a half's start (any dtype's alignment)
FIRST_CAPACITY = 1 << 24  # bytes per half at the first collective; a larger one grows every box alike


def _host_key() -> str:
    """What ranks that can share /dev/shm have in common: the boot, the network namespace and /dev/shm's device."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}|{boot}|{os.stat('/proc/self/ns/net').st_ino}|{os.stat(SHM_DIR).st_dev}"


def _agreed(comm: Transport, value: float) -> float:
    """``value`` summed over the group's ranks (float64, exact for integers below 2**53 / n)."""
    total = torch.tensor([value], dtype=torch.float64, device=comm.device)
    comm.all_reduce_sum(total)
    return float(total.item())


def on_one_host(comm: Transport) -> bool:
    """Whether every rank of ``comm``'s group is on this host with a usable /dev/shm: writable, with room for every
    rank's first box (every rank gets the same answer)."""
    if comm.device.type != "cpu" or comm.world_size < 2:
        return False
    try:
        key = _host_key()
        free = os.statvfs(SHM_DIR)
        room = free.f_bavail * free.f_frsize >= comm.world_size * 2 * FIRST_CAPACITY  # every rank's first box
        usable = os.access(SHM_DIR, os.W_OK) and room
    except OSError:
        key, usable = f"unknown-{os.getpid()}-{os.urandom(8).hex()}", False
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:3], "big") >> 3  # squares x 2**11 ranks < 2**53
    same = _agreed(comm, digest) == digest * comm.world_size and _agreed(comm, digest**2) == digest**2 * comm.world_size
    return _agreed(comm, float(same and usable)) == comm.world_size


def reserve(comm: Transport, path: str | None, nbytes: int, what: str) -> None:
    """``path`` made on this rank with ``nbytes`` reserved (None: nothing made here), agreed by every rank of
    ``comm``: where any rank lacks the room, each removes what it made and the lane is refused, naming its key. A
    full /dev/shm fails here, on every rank, not as a SIGBUS at a later write."""
    room = 1.0
    if path is not None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            room = 0.0
        finally:
            os.close(fd)
    if _agreed(comm, room) < comm.world_size:
        if path is not None:
            os.unlink(path)
        raise TensorShardUsageError(
            f"ds_tensorshard: {SHM_DIR} has no room for {what}; enlarge it (docker: --shm-size) or set "
            "'tensorshard.shared_memory': false"
        )


def mapped(path: str, nbytes: int) -> mmap.mmap:
    """The first ``nbytes`` of the file at ``path``, mapped shared."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class Boxes:
    """This rank's box and its peers', each of two halves of ``capacity`` bytes, in /dev/shm."""

    def __init__(self, comm: Transport, barrier: Callable[[], None]) -> None:
        self.comm, self.barrier = comm, barrier
        # rank 0's pid and 30 random bits (os.urandom: neither a seeded nor a forked random state repeats them)
        token = os.getpid() * 2**30 + int.from_bytes(os.urandom(4), "big") % 2**30 if comm.rank == 0 else 0
        self.prefix = f"{SHM_DIR}/ds_tensorshard_{int(_agreed(comm, token)):x}"
        self.capacity, self.generation = 0, 0
        self.maps: list[mmap.mmap] = []
        self.views: list[torch.Tensor] = []

    def ensure(self, nbytes: int) -> None:
        """Every box's halves at least ``nbytes`` (called with the same size on every rank: a collective's)."""
        if nbytes <= self.capacity:
            return
        capacity = max(FIRST_CAPACITY, -(-nbytes // ALIGN) * ALIGN)
        self.generation += 1
        name = f"{self.prefix}_{self.generation}_{{}}"
        what = f"the shared-memory lane's boxes ({self.comm.world_size} x {2 * capacity:,} bytes)"
        reserve(self.comm, name.format(self.comm.rank), 2 * capacity, what)
        try:
            maps = [mapped(name.format(rank), 2 * capacity) for rank in range(self.comm.world_size)]
            self.barrier()  # every rank has mapped every box: the names can go
        finally:  # (also where a peer failed: no name is left behind)
            os.unlink(name.format(self.comm.rank))
        self.views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self.maps, self.capacity = maps, capacity

    def half(self, rank: int, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s half for collective ``index``, as ``numel`` elements of ``dtype``."""
        start = (index % 2) * self.capacity
        return self.views[rank][start : start + numel * dtype.itemsize].view(dtype)


class HostSharedComm:
    """:class:`~ds_tensorshard.transports.protocol.Transport` over ``inner``'s group through shared memory; the
    norm's all-reduce, the barrier and :meth:`fail` stay ``inner``'s. A barrier that fails (its deadline, a lost
    peer) is raised where the collective is waited for, as the transports' own are, and every later collective
    fails the same way at once."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rank, self.world_size, self.global_ranks = inner.rank, inner.world_size, inner.global_ranks
        self.timeout_s, self.device = inner.timeout_s, inner.device
        self.name = f"{inner.name} + shared memory"
        self.broadcasts_by_owner = False  # a bucket's spans in one exchange
        self._tick = torch.zeros(1, device=inner.device)
        self._index, self._segments = 0, 0
        self._failed: Exception | None = None
        self.boxes = Boxes(inner, self._barrier)

    def _barrier(self) -> None:
        self.inner.all_reduce_sum(self._tick)

    def _exchange(
        self, flat: torch.Tensor, write: Sequence[Span], read: Callable[[list[torch.Tensor]], None], what: str
    ) -> Pending:
        """Write ``write``'s spans of ``flat`` into this rank's half, meet at the barrier, then ``read`` from
        every rank's half (laid out as ``flat``); ``what`` names the collective for a deadline."""
        flat = flat.view(-1)
        halves: list[torch.Tensor] = []

        def send() -> None:
            self.boxes.ensure(flat.numel() * flat.dtype.itemsize)
            index, self._index = self._index, self._index + 1
            halves.extend(self.boxes.half(rank, index, flat.dtype, flat.numel()) for rank in range(self.world_size))
            for _, offset, numel in write:
                halves[self.rank][offset : offset + numel].copy_(flat[offset : offset + numel])
            self._barrier()

        failed = self._failure(send, what)
        if failed is not None:
            return failed
        read(halves)
        return Pending(lambda: None)

    def _failure(self, meet: Callable[[], None], what: str) -> Pending | None:
        """None where ``meet`` (which ends at the barrier) got every rank there; else a collective that raises, at
        its wait, the failure kept for every later collective too: its deadline (named by ``what``), or a lost peer
        (the data path's wait names it)."""
        if self._failed is None:
            try:
                meet()
            except CollectiveTimeout:
                self._failed = CollectiveTimeout(f"{what} through shared memory")
            except RuntimeError as err:
                self._failed = err
        return None if self._failed is None else Pending(functools.partial(_raise, self._failed))

    def start_meet(self, what: str) -> Pending:
        """Every rank at the barrier: what a rank wrote into :meth:`shared_storage` before it, every rank reads
        after it."""
        return self._failure(self._barrier, what) or Pending(lambda: None)

    def has_room(self, nbytes: int) -> bool:
        """Whether /dev/shm has room for ``nbytes`` more on every rank (the same answer on every rank)."""
        free = os.statvfs(SHM_DIR)
        return _agreed(self.inner, float(free.f_bavail * free.f_frsize >= nbytes)) == self.world_size

    def shared_storage(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` zeros of ``dtype`` in one /dev/shm segment that every rank of the group maps: what one rank
        writes there, every rank reads after the next :meth:`start_meet` (flat parameters keep their storage
        there, :mod:`~ds_tensorshard.datapath.flat_parameters`). Unlinked once mapped, as the boxes are."""
        nbytes = max(numel * dtype.itemsize, 1)
        self._segments += 1
        path = f"{self.boxes.prefix}_storage_{self._segments}"
        reserve(self.inner, path if self.rank == 0 else None, nbytes, f"a shared storage of {nbytes:,} bytes")
        try:
            segment = mapped(path, nbytes)
            self._barrier()  # every rank has mapped it
        finally:  # (also where a peer failed: no name is left behind)
            if self.rank == 0:
                os.unlink(path)
        return torch.frombuffer(segment, dtype=torch.uint8)[: numel * dtype.itemsize].view(dtype)

    def _sum_into(self, flat: torch.Tensor, halves: list[torch.Tensor], offset: int, numel: int) -> None:
        """``flat[offset:offset+numel]`` summed over the ranks in rank order (this rank's part from ``flat``, the
        others' from their halves): the same bits whichever rank owns it, and an all-reduce's. Ranks 0 and 1 add in
        place (the first addition is commutative bit for bit); a later rank sums apart, then copies."""
        out = flat.view(-1)[offset : offset + numel]
        parts = [out if rank == self.rank else halves[rank][offset : offset + numel] for rank in range(self.world_size)]
        if self.rank <= 1:
            for part in [parts[1 - self.rank], *parts[2:]]:
                out.add_(part)
            return
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total.add_(part)
        out.copy_(total)

    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        return self.start_reduce_segments(tensor, [(owner, 0, tensor.numel())])

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        return self._broadcast(tensor, [(owner, 0, tensor.numel())], f"broadcast from rank {owner}")

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        def read(halves: list[torch.Tensor]) -> None:
            for owner, offset, numel in spans:
                if owner == self.rank:
                    self._sum_into(flat, halves, offset, numel)

        others = [span for span in spans if span[0] != self.rank]
        what = "reduce to rank " + ", ".join(str(owner) for owner, _, _ in spans)
        return self._exchange(flat, others, read, what)

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        return self._broadcast(flat, spans, "broadcast from rank " + ", ".join(str(o) for o, _, _ in spans))

    def _broadcast(self, flat: torch.Tensor, spans: Sequence[Span], what: str) -> Pending:
        """Each span of its owner's ``flat`` into every rank's ``flat``, in one exchange."""

        def read(halves: list[torch.Tensor]) -> None:
            out = flat.view(-1)
            for owner, offset, numel in spans:
                if owner != self.rank:
                    out[offset : offset + numel].copy_(halves[owner][offset : offset + numel])

        return self._exchange(flat, [span for span in spans if span[0] == self.rank], read, what)

    def start_reduce_scatter(self, flat: torch.Tensor, slot: int) -> Pending:
        return self.start_reduce_segments(flat, [(rank, rank * slot, slot) for rank in range(self.world_size)])

    def start_all_gather(self, flat: torch.Tensor, slot: int) -> Pending:
        slots = [(rank, rank * slot, slot) for rank in range(self.world_size)]
        return self._broadcast(flat, slots, f"all-gather of {self.world_size} slots")

    def start_all_reduce(self, flat: torch.Tensor) -> Pending:
        def read(halves: list[torch.Tensor]) -> None:
            out = flat.view(-1)
            out.copy_(halves[0])
            for rank in range(1, self.world_size):
                out.add_(halves[rank])

        return self._exchange(flat, [(self.rank, 0, flat.numel())], read, f"all-reduce of {flat.numel():,} elements")

    def all_reduce_sum(self, tensor: torch.Tensor, where: Callable[[], str] | None = None) -> None:
        self.inner.all_reduce_sum(tensor, where)

    def fail(self, message: str) -> NoReturn:
        self.inner.fail(message)


def _raise(error: Exception) -> None:
    raise error
