"""``"comm_backend": "mpi"``: the data path's collectives through mpi4py.

A bucket is reduced with one ``Ireduce_scatter`` (per-rank counts: each owner's segment, zero for a rank
owning nothing there), whatever the number of owners and the world size, and each owner's segment comes
back with one ``Ibcast``; both are non-blocking, so communication overlaps computation; nothing is padded.
CPU tensors are handed to MPI as numpy views (no copy).
bf16/fp16 travel as raw 16-bit words and are summed by a user-defined MPI op (MPI has no bf16
sum): each pairwise addition of the reduction is done in fp32 and rounded back to 16 bits, the
precision of NCCL's 16-bit reductions that stock ZeRO uses. CUDA tensors go to MPI directly where
mpi4py reports a CUDA-aware MPI (after the stream that produced them has finished), and through
pinned host memory otherwise (warned once). The MPI processes must be the torch.distributed processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ds_tensorshard.errors import CollectiveTimeout, TensorShardConfigError
from ds_tensorshard.transports import shutdown
from ds_tensorshard.transports.deadline import wait_with_deadline
from ds_tensorshard.transports.protocol import Pending, Span, all_of

_HALF = (torch.float16, torch.bfloat16)
_sum16_ops: dict = {}
_warned_staging = False


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise TensorShardConfigError(
            "'tensorshard.comm_backend' 'mpi' needs mpi4py: pip install "
            "'ds_tensorshard[mpi]' (mpi4py + mpich) or use comm_backend 'torch'"
        ) from err
    return MPI


def check_mpi_world() -> None:
    """The MPI world must be the torch.distributed world (same processes, same size)."""
    mpi = _mpi().COMM_WORLD
    torch_size = dist.get_world_size()
    if mpi.Get_size() != torch_size or sorted(mpi.allgather(dist.get_rank())) != list(range(torch_size)):
        raise TensorShardConfigError(
            f"'tensorshard.comm_backend' 'mpi' needs the MPI world to be the torch.distributed world, but MPI has "
            f"{mpi.Get_size()} process(es) and torch.distributed {torch_size} (under the local deepspeed launcher or "
            "torchrun every process is its own MPI singleton). Launch with 'mpiexec -n N python train.py' or "
            "'deepspeed --hostfile H --launcher mpich|openmpi --force_multi ...', or use comm_backend 'torch'"
        )


def check_thread_level(device: torch.device) -> None:
    """On an accelerator, autograd runs the gradient hooks (which start reductions) on its device threads while
    the training thread calls MPI too: MPI must allow calls from several threads, one at a time
    (``MPI_THREAD_SERIALIZED`` or ``MPI_THREAD_MULTIPLE``; mpi4py asks for MULTIPLE unless told otherwise)."""
    MPI = _mpi()
    provided = MPI.Query_thread()
    if device.type != "cpu" and provided < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED"}
        raise TensorShardConfigError(
            f"'tensorshard.comm_backend' 'mpi' on {device.type} needs MPI_THREAD_SERIALIZED or better (gradient "
            f"hooks call MPI from autograd's device threads), but MPI was initialized with "
            f"{names.get(provided, provided)}: leave mpi4py's default (mpi4py.rc.thread_level = 'multiple') or "
            "use comm_backend 'torch'"
        )


def _sum16(dtype: torch.dtype):
    """An MPI op summing raw 16-bit words of ``dtype`` in fp32 (on host buffers: :meth:`MpiComm._host` stages
    every 16-bit sum through host memory, whatever the MPI's CUDA support)."""
    if dtype not in _sum16_ops:

        def add(inbuf, inoutbuf, datatype) -> None:
            a = torch.frombuffer(inbuf, dtype=torch.int16).view(dtype)
            b = torch.frombuffer(inoutbuf, dtype=torch.int16).view(dtype)
            b.copy_((a.float() + b.float()).to(dtype))

        _sum16_ops[dtype] = _mpi().Op.Create(add, commute=True)
    return _sum16_ops[dtype]


def _cuda_aware() -> bool:
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    return bool(query()) if query is not None else False


class MpiComm:
    """mpi4py collectives over the MPI communicator whose ranks are the data-parallel group's."""

    def __init__(self, group, timeout_s: float, device: torch.device) -> None:
        MPI = _mpi()
        self.device = torch.device(device)
        check_mpi_world()
        check_thread_level(self.device)
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.mpi = MPI.COMM_WORLD.Split(color=min(self.global_ranks), key=self.rank)
        assert self.mpi.Get_rank() == self.rank and self.mpi.Get_size() == self.world_size
        self.cuda_aware = _cuda_aware()
        self.timeout_s = timeout_s
        self.name = "mpi"
        self.broadcasts_by_owner = True

    def _wait(self, request, what: str) -> None:
        """Drive ``request`` to completion, or raise CollectiveTimeout after ``timeout_s`` (MPI has no timed wait)."""
        if not wait_with_deadline(request.Test, self.timeout_s):
            raise CollectiveTimeout(what)

    def fail(self, message: str) -> NoReturn:
        """Log ``message`` and abort the whole MPI job, so that mpiexec returns (a stuck peer never would)."""
        logger.error(message)
        shutdown.fail(message, mpi=True)

    # -- buffers ------------------------------------------------------------------------------
    def _spec(self, tensor: torch.Tensor):
        """An mpi4py buffer spec for a contiguous tensor (numpy view on CPU, the tensor itself on CUDA)."""
        MPI = _mpi()
        if tensor.dtype in _HALF:
            data, mpi_type = tensor.view(torch.int16), MPI.SHORT
        else:
            data, mpi_type = (
                tensor,
                {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T}[tensor.dtype],
            )
        buf = data if data.device.type != "cpu" else data.numpy()
        return [buf, mpi_type]

    def _direct(self, tensor: torch.Tensor, summed: bool = False) -> bool:
        """Whether MPI takes ``tensor``'s memory as it is: a CPU tensor, or a device tensor where mpi4py reports a
        CUDA-aware MPI; not for a 16-bit sum (``summed``), a Python function (:func:`_sum16`) over host buffers."""
        return tensor.device.type == "cpu" or (self.cuda_aware and not (summed and tensor.dtype in _HALF))

    def _receive_buffer(self, like: torch.Tensor, numel: int, summed: bool = False) -> torch.Tensor:
        """Where MPI writes a result for ``like``: beside it where MPI takes its memory, else pinned host memory.
        Made before :meth:`_host` synchronizes the stream, so that no kernel still uses memory MPI writes into."""
        if self._direct(like, summed):
            return like.new_empty(numel)
        return torch.empty(numel, dtype=like.dtype, device="cpu", pin_memory=True)

    def _host(self, tensor: torch.Tensor, summed: bool = False) -> torch.Tensor:
        """What MPI may read now: a tensor it takes directly (:meth:`_direct`) once the stream that produces it
        is done, else a copy in pinned host memory."""
        global _warned_staging
        if tensor.device.type == "cpu":
            return tensor
        stream = get_accelerator().current_stream()
        if self._direct(tensor, summed):
            stream.synchronize()
            return tensor
        if not _warned_staging and not self.cuda_aware:
            logger.warning(
                "ds_tensorshard: mpi4py reports an MPI without CUDA support; "
                "staging CUDA tensors through pinned host memory"
            )
            _warned_staging = True
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        stream.synchronize()
        return host

    # -- the transport interface ------------------------------------------------------------------
    def start_reduce(self, tensor: torch.Tensor, owner: int) -> Pending:
        MPI = _mpi()
        host = self._host(tensor, summed=True)
        op = _sum16(host.dtype) if host.dtype in _HALF else MPI.SUM
        if self.rank == owner:
            request = self.mpi.Ireduce(MPI.IN_PLACE, self._spec(host), op=op, root=owner)
        else:
            request = self.mpi.Ireduce(self._spec(host), None, op=op, root=owner)
        return Pending(self._completion(request, f"reduce to rank {owner}", host, tensor, self.rank == owner), host)

    def start_broadcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        return self._ibcast(tensor, owner)

    def _ibcast(self, tensor: torch.Tensor, owner: int) -> Pending:
        host = self._host(tensor)
        request = self.mpi.Ibcast(self._spec(host), root=owner)
        return Pending(
            self._completion(request, f"broadcast from rank {owner}", host, tensor, self.rank != owner), host
        )

    def _counts(self, spans: Sequence[Span]) -> tuple[list[int], list[int]]:
        """Elements and offset per rank (0 and 0 for a rank owning nothing) of a bucket whose spans cover it
        back to back, owners ascending: MPI's rank-ordered layout of a reduce-scatter's input."""
        counts, offsets = [0] * self.world_size, [0] * self.world_size
        for owner, offset, numel in spans:
            counts[owner], offsets[owner] = numel, offset
        return counts, offsets

    def start_reduce_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        MPI = _mpi()
        counts, offsets = self._counts(spans)
        mine = self._receive_buffer(flat, counts[self.rank], summed=True)
        host = self._host(flat, summed=True)
        op = _sum16(host.dtype) if host.dtype in _HALF else MPI.SUM
        request = self.mpi.Ireduce_scatter(self._spec(host), self._spec(mine), recvcounts=counts, op=op)
        segment = flat[offsets[self.rank] : offsets[self.rank] + counts[self.rank]]

        def finish() -> None:
            self._wait(request, f"reduce-scatter to ranks {[owner for owner, _, _ in spans]}")
            segment.copy_(mine, non_blocking=segment.device.type != "cpu")

        return Pending(finish, host, mine)

    def start_broadcast_segments(self, flat: torch.Tensor, spans: Sequence[Span]) -> Pending:
        """One Ibcast from each owner: MPICH's Iallgatherv of a bucket took 8x the broadcasts' time in the
        benchmark (85.9M-parameter GPT, 2 ranks: 1.61 s against 0.12-0.20 s of gather per step)."""
        return all_of([self._ibcast(flat[offset : offset + numel], owner) for owner, offset, numel in spans], flat)

    def start_reduce_scatter(self, flat: torch.Tensor, slot: int) -> Pending:
        MPI = _mpi()
        mine = self._receive_buffer(flat, slot, summed=True)
        host = self._host(flat, summed=True)
        op = _sum16(host.dtype) if host.dtype in _HALF else MPI.SUM
        request = self.mpi.Ireduce_scatter_block(self._spec(host), self._spec(mine), op=op)
        segment = flat[self.rank * slot : (self.rank + 1) * slot]

        def finish() -> None:
            self._wait(request, f"reduce-scatter of {self.world_size} slots")
            segment.copy_(mine, non_blocking=segment.device.type != "cpu")

        return Pending(finish, host, mine)

    def start_all_gather(self, flat: torch.Tensor, slot: int) -> Pending:
        """In place: this rank's slot is sent from where it lies in ``flat`` (or its staged host copy), not copied
        out first."""
        host = self._host(flat)
        request = self.mpi.Iallgather(_mpi().IN_PLACE, self._spec(host))
        return Pending(self._completion(request, f"all-gather of {self.world_size} slots", host, flat, True), host)

    def start_all_reduce(self, flat: torch.Tensor) -> Pending:
        MPI = _mpi()
        host = self._host(flat, summed=True)
        op = _sum16(host.dtype) if host.dtype in _HALF else MPI.SUM
        request = self.mpi.Iallreduce(MPI.IN_PLACE, self._spec(host), op=op)
        return Pending(self._completion(request, f"all-reduce of {flat.numel():,} elements", host, flat, True), host)

    def _completion(
        self, request: Any, what: str, host: torch.Tensor, tensor: torch.Tensor, received: bool
    ) -> Callable[[], None]:
        """Wait for ``request``, then copy a staged result back to the device tensor."""

        def finish() -> None:
            self._wait(request, what)
            if received and host is not tensor:
                tensor.copy_(host, non_blocking=True)  # pinned: ordered on the stream, the host waits not

        return finish

    def all_reduce_sum(self, tensor: torch.Tensor, where: Callable[[], str] | None = None) -> None:
        host = self._host(tensor, summed=True)
        self._wait(self.mpi.Iallreduce(_mpi().IN_PLACE, self._spec(host), op=_mpi().SUM), "all-reduce")
        if host is not tensor:
            tensor.copy_(host)
