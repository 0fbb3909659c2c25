"""The stage-3 parameter protocol with whole-tensor meaning: what DeepSpeed's coordinator, ``GatheredParameters`` and
the frameworks call on a parameter, for parameters each owned whole (or in dim-0 blocks) by one rank.

DeepSpeed's stage 3 reaches a parameter only through its ``ds_*`` attributes and a few bound methods
(``all_gather``, ``all_gather_coalesced``, ``partition``, ``partition_numel``). :class:`OwnedParameters` keeps
that protocol, so DeepSpeed's hooks, trace, prefetch and release run unchanged:

- ``ds_tensor``: on the owner, the tensor itself (flat); on a rank that owns a dim-0 block of it, that block;
  elsewhere an empty placeholder. ``ts_blocks``: who owns which elements (:class:`~ds_tensorshard.datapath.plan.Block`).
- ``all_gather_coalesced(params)``: one collective per dtype from the owners (:mod:`.gather`: a broadcast per
  owner, or on accelerators one all-reduce or one all-gather where the cost model prices it better); on the owner the
  gathered parameter is its own ``ds_tensor`` again (nothing copied back at release).
- ``partition()``: releases the gathered tensor on every rank (an empty ``.data``, as stock's); with
  ``has_been_updated`` the owner first keeps the new values.
- ``partition_numel()``: the whole tensor's element count on every rank. The coordinator gathers a module's
  parameters only when this is positive: a count that differed by rank (an owner's against a peer's) would leave
  one rank out of a collective the others enter.

Every rank enters the same gathers in the same order whatever it owns: availability is the same on every rank
(each gathered parameter is released everywhere), batches are in ``ds_id`` order, and persistence is decided by
size alone (stock's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

from ds_tensorshard.datapath.cost_model import padded_bytes
from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.datapath.stage3_cost import gather_route
from ds_tensorshard.parameters.gather import GatherInFlight, GatherLayout, start_gather
from ds_tensorshard.parameters.zero_param import ZeroParam
from ds_tensorshard.transports.protocol import Transport

MOVE_NUMEL = 50_000_000  # elements gathered at once when tensors move to new owners (stock's prefetch bucket)


class OwnedGather:
    """What ``all_gather_coalesced`` returns: the batch's collectives in flight (one per dtype); :meth:`wait` makes
    the parameters available (the coordinator calls it from its fetch)."""

    def __init__(self, owned: OwnedParameters, batches: list[tuple[list[ZeroParam], GatherInFlight | None]]) -> None:
        self.owned, self.batches, self.complete = owned, batches, False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        for params, in_flight in self.batches:
            wholes = in_flight.wait() if in_flight is not None else [None] * len(params)
            for param, whole in zip(params, wholes):
                param.data = self.owned.own_view(param) if self.owned.keeps_on_device(param) else whole
                param.ds_status = ZeroParamStatus.AVAILABLE
        self.complete = True


class OwnedParameters:
    """The protocol for the parameters of one process group (``comm``'s), whose ``ds_tensor`` live on
    ``home`` (the accelerator, or the host with ``offload_param``)."""

    def __init__(
        self,
        comm: Transport,
        home: torch.device,
        assign: Callable[[ZeroParam], tuple[Block, ...]],
        pin_memory: bool = False,
    ) -> None:
        self.comm, self.home, self.assign = comm, torch.device(home), assign
        # offload_param keeps the owners' tensors in host memory, page-locked where there is an accelerator
        self.pinned = pin_memory and self.home.type == "cpu" and comm.device.type != "cpu"
        self.rank = comm.rank
        self._layouts: dict[tuple[int, ...], GatherLayout] = {}

    # -- conversion ----------------------------------------------------------------------------------
    def adopt(self, param: ZeroParam) -> None:
        """After DeepSpeed's conversion set the ``ds_*`` attributes: the owners, and the bound methods whose
        meaning is whole-tensor."""
        if getattr(param, "ts_blocks", None) is None:
            param.ts_blocks = self.assign(param)
        param.ts_owned = self
        param.all_gather_coalesced = self._coalesced_of(param)
        param.partition_numel = lambda: param.ds_numel

    def _coalesced_of(self, param: ZeroParam):
        def all_gather_coalesced(params: Iterable[ZeroParam], safe_mode: bool = False, quantize: bool = False):
            return self.start(list(params))

        return all_gather_coalesced

    def keeps_on_device(self, param: ZeroParam) -> bool:
        """Whether this rank keeps ``param`` whole where it computes: the gathered parameter is then its own tensor."""
        blocks = param.ts_blocks
        return len(blocks) == 1 and blocks[0].rank == self.rank and param.ds_tensor.device == self.comm.device

    def own_view(self, param: ZeroParam) -> torch.Tensor:
        """The owner's tensor shaped as the parameter (where it is kept: the host with ``offload_param``)."""
        return param.ds_tensor.view(param.ds_shape)

    def my_block(self, param: ZeroParam) -> Block | None:
        return next((b for b in param.ts_blocks if b.rank == self.rank), None)

    # -- release (DeepSpeed's partition) -------------------------------------------------------------
    @torch.no_grad()
    def keep(self, param: ZeroParam, has_been_updated: bool, free_data: bool) -> None:
        """DeepSpeed's ``partition`` of one parameter: the first time, the owner keeps its block as ``ds_tensor``
        (the tensor itself where it owns it whole and it is where it is kept) and the others an empty placeholder;
        with ``has_been_updated`` the owner copies the parameter's new values into it; then the gathered tensor is
        released (``free_data``)."""
        assert param.ds_status is not ZeroParamStatus.INFLIGHT, f"parameter {param.ds_id} released in flight"
        block = self.my_block(param)
        if param.ds_tensor is None:
            param.ds_tensor = self._first_tensor(param, block)
            param.ds_tensor.ds_numel = param.ds_tensor.numel()
            param.ds_tensor.status = None
            param.ds_tensor.final_location = None
            param.ds_numel_aligned = param.ds_numel
        elif has_been_updated and block is not None and param.data.numel() == param.ds_numel:
            source = param.data.view(-1)[block.start : block.stop]
            if source.data_ptr() != param.ds_tensor.data_ptr():
                param.ds_tensor.copy_(source)
        if free_data or param.data.numel() != param.ds_numel:
            free_param(param)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE

    def _first_tensor(self, param: ZeroParam, block: Block | None) -> torch.Tensor:
        if block is None:
            return torch.empty(0, dtype=param.dtype, device=self.home)
        flat = param.data.reshape(-1)
        if block.numel == param.ds_numel and flat.device == self.home and _owns_its_storage(flat) and not self.pinned:
            return flat  # the tensor itself: nothing copied
        kept = torch.empty(block.numel, dtype=param.dtype, device=self.home, pin_memory=self.pinned)
        return kept.copy_(flat[block.start : block.stop])

    @torch.no_grad()
    def move(self, params: list[ZeroParam], blocks: list[tuple[Block, ...]]) -> None:
        """Give ``params`` (released, in ``ds_id`` order on every rank) new owners ``blocks``: each is gathered from
        its owners now, then kept by its new ones; a batch of at most :data:`MOVE_NUMEL` elements at a time. The
        layouts made before (``zero.Init``'s gathers: ``apply``, ``GatheredParameters`` while HF loads the weights)
        name the old owners: they are dropped."""
        start = 0
        while start < len(params):
            stop, numel = start, 0
            while stop < len(params) and (stop == start or numel + params[stop].ds_numel <= MOVE_NUMEL):
                numel += params[stop].ds_numel
                stop += 1
            batch = params[start:stop]
            self.gather_now(batch)
            for param, new in zip(batch, blocks[start:stop]):
                param.ts_blocks, param.ds_tensor = new, None
                self.keep(param, has_been_updated=False, free_data=True)
            start = stop
        self._layouts.clear()

    # -- gather ---------------------------------------------------------------------------------------
    def start(self, params: list[ZeroParam]) -> OwnedGather:
        """``all_gather_coalesced``: the parameters not available are gathered, one collective per dtype, in
        ``ds_id`` order (every rank's)."""
        wanted = sorted((p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE), key=lambda p: p.ds_id)
        by_dtype: dict[torch.dtype, list[ZeroParam]] = {}
        for param in wanted:
            by_dtype.setdefault(param.dtype, []).append(param)
            param.ds_status = ZeroParamStatus.INFLIGHT
        batches: list[tuple[list[ZeroParam], GatherInFlight | None]] = []
        for dtype in sorted(by_dtype, key=str):
            batch = by_dtype[dtype]
            if self.comm.world_size == 1 and all(self.keeps_on_device(p) for p in batch):
                batches.append((batch, None))  # one rank, every tensor its own: nothing moves
            else:
                batches.append((batch, start_gather(batch, self.layout_of(batch), self.comm)))
        return OwnedGather(self, batches)

    def gather_now(self, params: Iterable[ZeroParam]) -> None:
        """``all_gather`` (``GatheredParameters``, ``param.all_gather()``): gather and wait."""
        self.start(list(params)).wait()

    def layout_of(self, batch: list[ZeroParam]) -> GatherLayout:
        """The batch's layout, made once per batch (the coordinator fetches the same batches every step)."""
        key = tuple(p.ds_id for p in batch)
        layout = self._layouts.get(key)
        if layout is None:
            blocks, n = [p.ts_blocks for p in batch], self.comm.world_size
            layout = GatherLayout.of(blocks, self.rank)
            if self.comm.device.type != "cpu":  # accelerators: the route the model prices best on every fabric
                size = batch[0].element_size()
                stock = padded_bytes([p.ds_numel for p in batch], range(len(batch)), n, size)  # stock's all-gather
                route = gather_route([numel * size for _, _, numel in layout.spans], stock, n)
                layout = GatherLayout.of(blocks, self.rank, route, n)
            self._layouts[key] = layout
        return layout


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage (keeping it keeps nothing else alive)."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
