"""Buckets: bounded windows of the gradient stream, grouped by owner inside.

Per dtype (and communication dtype, where DeepSpeed's ``torch_autocast`` marks some tensors to travel in
its autocast dtype), the owned units (whole tensors, or the blocks of split ones) are taken in backward
order and cut into buckets of exactly ``bucket_numel`` elements (the last one per dtype less): a
bucket holds gradients that backward produces at about the same time, and a large tensor travels
in pieces over several buckets while its owner stays one rank. Inside a bucket the pieces are
grouped by owner, owners ascending, back to back: segment ``r`` is what rank ``r`` receives
reduced and later sends back updated. Segments have whatever size ownership gives them; the
transports reduce them with one operation per bucket where the backend has one (mpi's reduce-scatter;
else one reduce per owner) and broadcast them back one per owner, so nothing is padded. A bucket is packed into a
flat buffer only while it is in flight.

Worked example: tensors ``a`` (6 elements, rank 1), ``b`` (4, rank 0), ``c`` (5, rank 1) in
backward order, ``bucket_numel=8``: bucket 0 = [segment 0: b[0:2] | segment 1: a[0:6]], bucket 1 =
[segment 0: b[2:4] | segment 1: c[0:5]] (7 elements).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ds_tensorshard.datapath.plan import Block


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of a parameter's flattened storage."""

    param: torch.nn.Parameter
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The same elements of a contiguous tensor shaped like the parameter (its data or gradient), as a view
        (a whole tensor's without a slice: one operator dispatched, not two)."""
        flat = tensor.view(-1)
        return flat if self.start == 0 and self.stop == flat.numel() else flat[self.start : self.stop]


@dataclass(frozen=True)
class Segment:
    """The pieces one rank owns in a bucket, at ``offset`` of the bucket's flat buffer."""

    owner: int
    offset: int
    numel: int
    pieces: tuple[Piece, ...]

    @property
    def sizes(self) -> list[int]:
        """Each piece's elements, in order."""
        return [piece.numel for piece in self.pieces]

    def views(self, flat_segment: torch.Tensor) -> Iterator[tuple[Piece, torch.Tensor]]:
        """``(piece, its part of flat_segment)`` for each piece, in order (the parts made in one call)."""
        yield from zip(self.pieces, flat_segment.split(self.sizes))


@dataclass(frozen=True, eq=False)
class Bucket:
    """Segments of one dtype, owners ascending, back to back in a flat buffer of ``numel`` elements."""

    dtype: torch.dtype
    device: torch.device
    segments: tuple[Segment, ...]
    numel: int
    params: tuple[torch.nn.Parameter, ...]
    """Every parameter with a piece here: the bucket can start once all of their gradients are final."""
    comm_dtype: torch.dtype | None = None
    """The dtype its gradients travel in, where the tensors say (DeepSpeed's autocast marks); None: the
    config's ``communication_data_type`` (see :class:`~ds_tensorshard.datapath.reduce.Averaging`)."""
    slot: int = 0
    """A stripe's elements per rank (:func:`build_stripes`): segment ``r`` at ``r x slot``, padded to it, so the
    bucket moves with one reduce-scatter and one all-gather; 0: a window, segments back to back."""
    by_all_reduce: tuple[bool, bool] = (False, False)
    """A stripe's (reduction, gather) each as one all-reduce of the whole stripe instead of its reduce-scatter,
    its all-gather (:class:`~ds_tensorshard.datapath.defaults.StripeRoutes`)."""
    _views: dict = field(default_factory=dict, compare=False, repr=False)  # owner -> (storages, model views)

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """``(owner, offset, numel)`` of each segment: what a transport moves the bucket by."""
        return [(s.owner, s.offset, s.numel) for s in self.segments]

    def segment_of(self, rank: int) -> Segment | None:
        return next((s for s in self.segments if s.owner == rank), None)

    def pack(
        self,
        tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None],
        dtype: torch.dtype | None = None,
        divisor: float = 1.0,
    ) -> torch.Tensor:
        """The bucket's flat buffer (in ``dtype``, default the bucket's) from one tensor per parameter
        (zeros where there is none), divided by ``divisor``: the segments lie back to back in piece order."""
        dtype = dtype or self.dtype
        if self.slot:  # a stripe: each segment in its slot, the padding zeros
            flat = torch.zeros(self.numel, dtype=dtype, device=self.device)
            for segment in self.segments:
                _cat(segment.pieces, tensor_of, flat[segment.offset : segment.offset + segment.numel], divisor)
            return flat
        return _cat(tuple(self.pieces()), tensor_of, torch.empty(self.numel, dtype=dtype, device=self.device), divisor)

    def model_views(self, segment: Segment) -> list[torch.Tensor]:
        """Views of the model's tensors for ``segment``'s pieces (what its owner sends and the others receive),
        made once (a view is an operator dispatched) and again only where a tensor's storage changed (an
        offload, a load)."""
        storages = [piece.param.data_ptr() for piece in segment.pieces]
        cached = self._views.get(segment.owner)
        if cached is None or cached[0] != storages:
            cached = self._views[segment.owner] = (storages, [piece.of(piece.param.data) for piece in segment.pieces])
        return cached[1]

    def forget_views(self) -> None:
        """Drop the views made of the model's tensors (they moved: the views would keep the old memory)."""
        self._views.clear()

    def pieces(self) -> Iterator[Piece]:
        for segment in self.segments:
            yield from segment.pieces


def _cat(
    pieces: Sequence[Piece],
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None],
    out: torch.Tensor,
    divisor: float = 1.0,
) -> torch.Tensor:
    """``out`` = the pieces' tensors back to back, divided by ``divisor``: concatenated in one call then divided,
    or, on the host where every tensor is in ``out``'s dtype already, each divided into its place (one pass over
    the gradients, not two, the same quotients; an accelerator keeps the one concatenation's launch)."""
    parts = [None if (source := tensor_of(piece.param)) is None else piece.of(source) for piece in pieces]
    mixed = any(part is not None and part.dtype != out.dtype for part in parts)
    if divisor == 1.0 or mixed or out.device.type != "cpu":
        torch.cat([out.new_zeros(p.numel) if part is None else part for p, part in zip(pieces, parts)], out=out)
        return out.div_(divisor) if divisor != 1.0 else out
    start = 0
    for piece, part in zip(pieces, parts):
        place = out[start : start + piece.numel]
        if part is None:
            place.zero_()
        else:
            torch.div(part, divisor, out=place)
        start += piece.numel
    return out


@dataclass(frozen=True)
class _Unit:
    param: torch.nn.Parameter
    owner: int
    start: int
    stop: int


def build_buckets(
    params: Sequence[torch.nn.Parameter],
    blocks_of: Callable[[torch.nn.Parameter], Sequence[Block]],
    bucket_numel: int,
    comm_dtype_of: Callable[[torch.nn.Parameter], torch.dtype | None] = lambda param: None,
    dtype_of: Callable[[torch.nn.Parameter], torch.dtype] = lambda param: param.dtype,
) -> list[Bucket]:
    """Cut ``params`` (given in backward order) into buckets of ``bucket_numel`` elements per dtype (``dtype_of``:
    the one a parameter was planned in, whatever a module cast it to since) and communication dtype
    (``comm_dtype_of``; None: the config's)."""
    streams: dict[tuple[torch.dtype, torch.dtype | None], list[_Unit]] = {}
    for param in params:
        for block in blocks_of(param):
            if block.numel:
                key = (dtype_of(param), comm_dtype_of(param))
                streams.setdefault(key, []).append(_Unit(param, block.rank, block.start, block.stop))
    buckets = []
    for (dtype, comm_dtype), units in streams.items():
        window: list[Piece] = []
        owners: list[int] = []
        filled = 0
        for unit in units:
            start = unit.start
            while start < unit.stop:
                stop = min(unit.stop, start + bucket_numel - filled)
                window.append(Piece(unit.param, start, stop))
                owners.append(unit.owner)
                filled += stop - start
                start = stop
                if filled == bucket_numel:
                    buckets.append(_bucket(dtype, window, owners, comm_dtype))
                    window, owners, filled = [], [], 0
        if window:
            buckets.append(_bucket(dtype, window, owners, comm_dtype))
    return buckets


def _bucket(dtype: torch.dtype, pieces: list[Piece], owners: list[int], comm_dtype: torch.dtype | None) -> Bucket:
    by_owner: dict[int, list[Piece]] = {}
    for piece, owner in zip(pieces, owners):
        by_owner.setdefault(owner, []).append(piece)
    segments, offset = [], 0
    for owner in sorted(by_owner):
        numel = sum(p.numel for p in by_owner[owner])
        segments.append(Segment(owner, offset, numel, tuple(by_owner[owner])))
        offset += numel
    params = tuple({id(p.param): p.param for p in pieces}.values())
    device = pieces[0].param.device
    return Bucket(dtype, device, tuple(segments), offset, params, comm_dtype)


def build_stripes(
    params: Sequence[torch.nn.Parameter],
    blocks_of: Callable[[torch.nn.Parameter], Sequence[Block]],
    bucket_numel: int,
    world_size: int,
    comm_dtype_of: Callable[[torch.nn.Parameter], torch.dtype | None] = lambda param: None,
    routes: Callable[[int], tuple[bool, bool]] = lambda nbytes: (False, False),
    dtype_of: Callable[[torch.nn.Parameter], torch.dtype] = lambda param: param.dtype,
) -> list[Bucket]:
    """Buckets as stripes across the ranks: per dtype and communication dtype, each rank's owned units (in
    ``params``' backward order) form its own stream, and bucket ``k`` holds elements ``[k x slot, (k + 1) x
    slot)`` of every rank's stream, ``slot = bucket_numel // world_size`` (the last bucket as much as the
    fullest rank has left). Ownership is the plan's; a unit crossing a slot boundary travels in two pieces.
    ``routes(nbytes)`` says which of a stripe's collectives go as all-reduces (``Bucket.by_all_reduce``), by its
    size in its communication dtype (else its own). ``dtype_of`` as in :func:`build_buckets`."""
    streams: dict[tuple[torch.dtype, torch.dtype | None], list[list[_Unit]]] = {}
    for param in params:
        for block in blocks_of(param):
            if block.numel:
                key = (dtype_of(param), comm_dtype_of(param))
                per_rank = streams.setdefault(key, [[] for _ in range(world_size)])
                per_rank[block.rank].append(_Unit(param, block.rank, block.start, block.stop))
    buckets = []
    for (dtype, comm_dtype), per_rank in streams.items():
        left = [sum(u.stop - u.start for u in units) for units in per_rank]
        cursors = [(0, units[0].start if units else 0) for units in per_rank]  # (unit index, next element)
        while max(left):
            slot = min(max(1, bucket_numel // world_size), max(left))
            segments: list[Segment] = []
            members: dict[int, torch.nn.Parameter] = {}
            for rank, units in enumerate(per_rank):
                index, start = cursors[rank]
                pieces, numel = [], 0
                while numel < slot and index < len(units):
                    stop = min(units[index].stop, start + slot - numel)
                    pieces.append(Piece(units[index].param, start, stop))
                    numel += stop - start
                    start = stop
                    if start == units[index].stop:
                        index += 1
                        start = units[index].start if index < len(units) else 0
                cursors[rank], left[rank] = (index, start), left[rank] - numel
                if pieces:
                    segments.append(Segment(rank, rank * slot, numel, tuple(pieces)))
                    members.update((id(p.param), p.param) for p in pieces)
            device, numel = segments[0].pieces[0].param.device, world_size * slot
            by_all_reduce = routes(numel * (comm_dtype or dtype).itemsize)
            held = tuple(members.values())
            buckets.append(Bucket(dtype, device, tuple(segments), numel, held, comm_dtype, slot, by_all_reduce))
    return buckets
