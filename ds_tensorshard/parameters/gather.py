"""Gathering whole tensors from their owners: one collective per batch of parameters and dtype.

A batch is what DeepSpeed's stage-3 coordinator fetches at once (a module's parameters, and the ones it prefetches),
in ``ds_id`` order on every rank. Its owned blocks are laid rank-major in one flat buffer (rank 0's blocks first, each
rank's in the batch's order): each owner copies its blocks into its span, and the spans move with one broadcast from
each owner present (:meth:`~ds_tensorshard.transports.protocol.Transport.start_broadcast_segments`: the bytes of an
all-gather, nothing padded). Afterwards a parameter owned whole is a view of the buffer (its owner's, its own
tensor); a parameter owned in dim-0 blocks by several ranks is put together from its blocks.

Example, two ranks, a batch ``[a (owner 1, 6 elements), b (owner 0, 4), c (owner 1, 2)]``: the buffer is
``[b | a | c]``, spans ``(0, 0, 4)`` and ``(1, 4, 8)``; rank 1 copies ``a`` and ``c`` into elements 4-12 and
rank 0 ``b`` into 0-4; after the two broadcasts ``a`` is ``buffer[4:10]`` on rank 0.

On accelerators the batch may go another way, the one :func:`~ds_tensorshard.datapath.stage3_cost.gather_route`
prices furthest below stock's all-gather on the fabric where it fares worst (``GatherLayout.route``; CPU ranks keep
the broadcasts, ``ds-tensorshard plan --stage 3`` prints each):

- ``"all_reduce"``: one all-reduce of the whole buffer, every rank filling it with -0.0 around its own span: the
  sum adds -0.0 to each value, which changes no bit of it (a zero's sign kept), in any order of summation. It
  wins where a batch has many owners at many ranks (one tree against a chain per owner).
- ``"all_gather"``: one all-gather, each rank's span in a slot of the widest span's size (rank r's at
  ``r x slot``, padding after it never read). It wins where every rank holds a like share of the batch: the
  tensors a stage-3 plan on accelerators cuts into a block of rows on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.datapath.stage3_cost import GatherRoute
from ds_tensorshard.parameters.zero_param import ZeroParam
from ds_tensorshard.transports.protocol import Pending, Span, Transport, all_of


@dataclass
class GatherLayout:
    """Where a batch's blocks lie in its flat buffer (made once per batch, see the module's account)."""

    numel: int
    spans: list[Span]
    pieces: list[list[tuple[int, int]]]
    """Per parameter of the batch, its blocks' ``(offset, numel)`` in the buffer, in storage order."""
    mine: list[tuple[int, int]] = field(default_factory=list)
    """This rank's blocks: ``(parameter index, offset)``, in buffer order (its span, back to back)."""
    route: GatherRoute = "broadcasts"
    """How the spans move (the module's account)."""
    slot: int = 0
    """``"all_gather"``: elements per rank's slot (the widest span); the buffer is ``world_size x slot``."""

    @classmethod
    def of(
        cls, blocks: Sequence[Sequence[Block]], rank: int, route: GatherRoute = "broadcasts", world_size: int = 0
    ) -> GatherLayout:
        """The layout of a batch whose parameters have ``blocks`` (each in storage order), for ``rank``, gathered
        by ``route`` (``"all_gather"``: over ``world_size`` ranks)."""
        by_rank: dict[int, list[tuple[int, Block]]] = {}
        for index, held in enumerate(blocks):
            for block in held:
                by_rank.setdefault(block.rank, []).append((index, block))
        slot = max(sum(b.numel for _, b in held) for held in by_rank.values()) if route == "all_gather" else 0
        at: dict[tuple[int, int], int] = {}
        spans, mine, offset = [], [], 0
        for owner in sorted(by_rank):
            start = offset = owner * slot if slot else offset
            for index, block in by_rank[owner]:
                at[(index, block.start)] = offset
                if owner == rank:
                    mine.append((index, offset))
                offset += block.numel
            spans.append((owner, start, offset - start))
        pieces = [[(at[(i, b.start)], b.numel) for b in held] for i, held in enumerate(blocks)]
        return cls(world_size * slot if slot else offset, spans, pieces, mine, route, slot)


class GatherInFlight:
    """A batch's collective in flight; :meth:`wait` completes it and gives each parameter its whole tensor."""

    def __init__(self, params: list[ZeroParam], layout: GatherLayout, flat: torch.Tensor, pending: Pending) -> None:
        self.params, self.layout, self.flat, self.pending = params, layout, flat, pending

    def wait(self) -> list[torch.Tensor]:
        """The whole tensors, in the batch's order (each shaped as its parameter)."""
        self.pending.wait()
        flat = self.flat
        whole = []
        for param, pieces in zip(self.params, self.layout.pieces):
            shape = param.ds_shape
            if _contiguous(pieces):  # one block, or blocks back to back (one owner's span after another's): a view
                offset, numel = pieces[0][0], sum(n for _, n in pieces)
                whole.append(flat[offset : offset + numel].view(shape))
            else:
                whole.append(torch.cat([flat[offset : offset + numel] for offset, numel in pieces]).view(shape))
        return whole


def _contiguous(pieces: list[tuple[int, int]]) -> bool:
    """Whether a parameter's blocks lie back to back in the buffer, in storage order."""
    return all(offset + numel == after for (offset, numel), (after, _) in zip(pieces, pieces[1:]))


def start_gather(params: list[ZeroParam], layout: GatherLayout, comm: Transport) -> GatherInFlight:
    """Start gathering ``params`` (one dtype, the batch's order on every rank): this rank's blocks (its
    ``ds_tensor`` of each parameter in ``layout.mine``) go into its span, then the spans move by ``layout.route``
    (``"all_reduce"``: the rest of the buffer -0.0). Where this rank's span is one tensor it owns whole where it
    computes, and the batch goes by broadcasts, that tensor is broadcast as it is: nothing copied (the gathered
    parameter is that tensor on this rank, the span is never read), where the transport lets an owner broadcast
    its span from elsewhere (``broadcasts_by_owner``)."""
    summed = layout.route == "all_reduce"
    if summed:
        flat = torch.full((layout.numel,), -0.0, dtype=params[0].dtype, device=comm.device)
    else:
        flat = torch.empty(layout.numel, dtype=params[0].dtype, device=comm.device)
    own = None
    if layout.mine:
        sources = [params[index].ds_tensor.view(-1) for index, _ in layout.mine]
        first = layout.mine[0][1]
        span = flat[first : first + sum(s.numel() for s in sources)]
        as_is = layout.route == "broadcasts" and comm.broadcasts_by_owner
        if len(sources) == 1 and as_is and _sendable_as_is(params[layout.mine[0][0]], sources[0], flat):
            own = sources[0]
        elif len(sources) == 1:
            span.copy_(sources[0])
        else:
            torch.cat([s.to(device=flat.device, dtype=flat.dtype) for s in sources], out=span)
    if summed:
        return GatherInFlight(params, layout, flat, comm.start_all_reduce(flat))
    if layout.route == "all_gather":
        return GatherInFlight(params, layout, flat, comm.start_all_gather(flat, layout.slot))
    if own is None:
        return GatherInFlight(params, layout, flat, comm.start_broadcast_segments(flat, layout.spans))
    pending = [
        comm.start_broadcast(own if owner == comm.rank else flat[offset : offset + numel], owner)
        for owner, offset, numel in layout.spans
    ]
    return GatherInFlight(params, layout, flat, all_of(pending, flat, own))


def _sendable_as_is(param: ZeroParam, source: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether ``source`` (this rank's ``ds_tensor`` of ``param``) is the whole tensor, where and as ``flat`` is:
    then the gathered parameter is ``source`` itself on this rank, and ``flat``'s span of it is never read."""
    return len(param.ts_blocks) == 1 and source.device == flat.device and source.dtype == flat.dtype
