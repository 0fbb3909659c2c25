"""Flat parameters (``bucket_layout: "flat"``): a flat plan's tensors (:mod:`~ds_tensorshard.datapath.flat_plan`)
made views of one storage of ``world_size`` equal slots, so that after the step one collective, in place, brings
every owner's updated slot to every rank, as stock ZeRO-1/2 all-gathers into its flat parameter group. CPU ranks
of one host (the shared-memory lane) keep one storage that all of them map: each owner updates its slot in place,
and the gather is a barrier, no byte copied."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_tensorshard.datapath.plan import OwnershipPlan
from ds_tensorshard.transports.deadline import wait_or_fail
from ds_tensorshard.transports.host_shared import HostSharedComm
from ds_tensorshard.transports.protocol import Pending, Transport


def shared_lane(comm: Transport, nbytes: int) -> HostSharedComm | None:
    """``comm`` where it is the shared-memory lane and /dev/shm has room for a storage of ``nbytes`` on every rank
    (a container's small /dev/shm keeps the storage in each rank's memory); else None."""
    return comm if isinstance(comm, HostSharedComm) and comm.has_room(nbytes) else None


class FlatParameters:
    """The storage and the parameters laid in it (each ``.data`` a view at its plan offset; the padding zeros).
    Through the shared-memory lane, with room in /dev/shm, the storage is the group's one shared segment (``lane``),
    filled by rank 0, whose values every rank has (the engine broadcast them)."""

    def __init__(self, params: list[torch.nn.Parameter], plan: OwnershipPlan, comm: Transport) -> None:
        self.params, self.comm, self.slot = params, comm, plan.flat_slot
        self.offsets = [plan.flat_offsets[plan.name_of(param)] for param in params]
        self.ids = {id(param) for param in params}
        self.by_all_reduce = False  # set with the layout: gathered as one all-reduce (StripeRoutes), not an all-gather
        first, numel = params[0], comm.world_size * self.slot
        self.lane = shared_lane(comm, numel * first.element_size())
        if self.lane is not None:
            self.storage = self.lane.shared_storage(numel, first.dtype)
        else:
            self.storage = torch.zeros(numel, dtype=first.dtype, device=first.device)
        fills = self.lane is None or comm.rank == 0
        with torch.no_grad():
            self._lay(lambda param, view: view.copy_(param.data) if fills else None)
        if self.lane is not None:
            where = lambda: "laying the flat parameters in shared memory"  # noqa: E731
            wait_or_fail(self.lane.start_meet(where()).wait, comm, where)

    def _lay(self, fill: Callable[[torch.nn.Parameter, torch.Tensor], object]) -> None:
        """Each parameter becomes its view of the storage, ``fill(param, view)`` first."""
        for param, offset in zip(self.params, self.offsets):
            view = self.storage[offset : offset + param.numel()].view(param.shape)
            fill(param, view)
            param.data = view

    def __contains__(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.ids

    def start_gather(self) -> Pending:
        """Every rank's slot to every rank, in place (each owner's updated tensors are in its slot already): one
        all-gather, or one all-reduce with every other slot -0.0 first (adding -0.0 keeps each value and a zero's
        sign). Through the shared-memory lane, the barrier alone: every owner's update is in the one storage."""
        if self.lane is not None:
            return self.lane.start_meet("the flat parameters' gather")
        if not self.by_all_reduce:
            return self.comm.start_all_gather(self.storage, self.slot)
        mine = self.comm.rank * self.slot
        self.storage[:mine].fill_(-0.0)
        self.storage[mine + self.slot :].fill_(-0.0)
        return self.comm.start_all_reduce(self.storage)

    def move(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The storage to where ``moved`` puts it (``offload_states``), every parameter a view of it again; a
        storage moved out of shared memory is gathered by the transport's collectives from then on."""
        storage = moved(self.storage)
        if storage.data_ptr() != self.storage.data_ptr():
            self.lane = None
        self.storage = storage
        self._lay(lambda param, view: None)


class FlatGather:
    """A gather of flat parameters left running (``step_many``'s deferred broadcasts); :meth:`finish` completes it."""

    def __init__(self, flat: FlatParameters, where: Callable[[], str]) -> None:
        self.flat, self.where = flat, where
        self.in_flight = [flat.start_gather().describe_as(where)]  # under way until finish(), as Broadcast's

    def finish(self) -> None:
        while self.in_flight:
            wait_or_fail(self.in_flight.pop().wait, self.flat.comm, self.where)
