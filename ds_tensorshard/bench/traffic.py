"""The bytes a rank sends through collectives, counted by wrapping torch.distributed's collectives and the mpi
transport's, and the bytes a rank writes into shared memory for the others (ranks on one host,
:mod:`~ds_tensorshard.transports.host_shared`). Ring-algorithm model: all-reduce 2(n-1)/n, reduce-scatter and
all-gather (n-1)/n of the full buffer; a reduce is sent once by every rank but its root, a broadcast once by every
rank but the one before its root, the last of the ring."""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict

import torch.distributed as tdist

SENT: defaultdict[str, float] = defaultdict(float)  # bytes sent by this rank, per collective kind
_FACTORS = {
    "all_reduce": lambda n, root, me: 2 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n, root, me: (n - 1) / n,
    "all_gather_into_tensor": lambda n, root, me: (n - 1) / n,
    "reduce_scatter_single": lambda n, root, me: (n - 1) / n,  # FSDP2 calls these (torch 2.13)
    "all_gather_single": lambda n, root, me: (n - 1) / n,
    "broadcast": lambda n, root, me: float(me != (root - 1) % n),
    "reduce": lambda n, root, me: float(me != root),
}
_FULL_BUFFER = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "reduce_scatter_tensor": "input",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_single": "input",
    "all_gather_single": "output_tensor",
}
_ROOT = {"broadcast": "src", "reduce": "dst"}


def count_torch_collectives() -> None:
    """Wrap torch.distributed collectives (before DeepSpeed binds them) to add up bytes sent."""
    for name, factor in _FACTORS.items():
        original = getattr(tdist, name, None)
        if original is None:  # an older torch, whose FSDP2 calls the *_tensor ones
            continue
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, _original=original, _name=name, _factor=factor, _signature=signature, **kwargs):
            bound = _signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            n = tdist.get_world_size(group) if tdist.is_initialized() else 1
            me = tdist.get_rank(group) if tdist.is_initialized() else 0
            root = (
                tdist.get_group_rank(group, bound[_ROOT[_name]])
                if _name in _ROOT and group is not None
                else bound.get(_ROOT.get(_name, ""), 0)
            )
            tensor = bound[_FULL_BUFFER[_name]]
            SENT[_name] += _factor(n, root, me) * tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)

        setattr(tdist, name, counted)


def count_mpi_collectives() -> None:
    """Wrap the mpi transport's collectives to add up bytes sent (a segmented one as a rooted one per owner)."""
    from ds_tensorshard.transports import mpi_comm

    rooted = (("start_reduce", "reduce"), ("start_broadcast", "broadcast"))
    whole = (("all_reduce_sum", "all_reduce"), ("start_all_reduce", "all_reduce"))  # the norm's; a routed stripe's
    for name, kind in rooted + whole:
        original = getattr(mpi_comm.MpiComm, name)

        @functools.wraps(original)
        def counted(self, tensor, *args, _original=original, _kind=kind):
            factor = _FACTORS[_kind](self.world_size, args[0] if args else 0, self.rank)
            SENT["mpi_" + _kind] += factor * tensor.numel() * tensor.element_size()
            return _original(self, tensor, *args)

        setattr(mpi_comm.MpiComm, name, counted)
    for name, kind in (("start_reduce_segments", "reduce"), ("start_broadcast_segments", "broadcast")):
        original = getattr(mpi_comm.MpiComm, name)

        @functools.wraps(original)
        def counted_segments(self, flat, spans, _original=original, _kind=kind):
            for owner, _offset, numel in spans:  # as a rooted collective per owner would send
                SENT["mpi_" + _kind] += _FACTORS[_kind](self.world_size, owner, self.rank) * numel * flat.element_size()
            return _original(self, flat, spans)

        setattr(mpi_comm.MpiComm, name, counted_segments)
    for name in ("start_reduce_scatter", "start_all_gather"):  # a stripe: (n - 1) / n of its whole buffer
        original = getattr(mpi_comm.MpiComm, name)

        @functools.wraps(original)
        def counted_stripe(self, flat, slot, _original=original, _name=name):
            SENT["mpi_" + _name] += (self.world_size - 1) / self.world_size * flat.numel() * flat.element_size()
            return _original(self, flat, slot)

        setattr(mpi_comm.MpiComm, name, counted_stripe)


def count_shared_memory() -> None:
    """Wrap the shared-memory lane's exchange to add up the bytes a rank writes for the others to read."""
    from ds_tensorshard.transports import host_shared

    original = host_shared.HostSharedComm._exchange

    @functools.wraps(original)
    def counted(self, flat, write, read, what, _original=original):
        SENT["shared_memory"] += sum(numel for _owner, _offset, numel in write) * flat.element_size()
        return _original(self, flat, write, read, what)

    host_shared.HostSharedComm._exchange = counted  # type: ignore[method-assign]
