"""Gradients: the step's reduced gradients of a rank's owned tensors, in flat buffers.

Per param group, the tensors (or dim-0 blocks) a rank owns lie back to back in one flat buffer, in the
accumulation dtype (``grad_accum_dtype``, else the model's, as stock ZeRO-2 accumulates), the tensors the norm
counts first. With ZeRO-Offload the buffer is pinned host memory, made once; DeepSpeed's Muon matrices have a
buffer of their own (on the accelerator, where Newton-Schulz runs them, even with ZeRO-Offload), so that the
norm's sums are the same with offload and without. A reduced bucket segment is added into the buffers with one
multi-tensor add over views of its pieces, made once. The step's fp32 gradients are views fixed at start-up (of
the buffer itself, or of one fp32 buffer it is cast into at the step): the step's work is per buffer, not per
tensor: a cast, the norm's chunked fp64 dots, one multiply to unscale and clip, one zeroing after the update.
With bf16 masters (``bf16.bf16_master_weights_and_grads``) the step's gradients are in the wider of the
accumulation and master dtypes, the norm's; where that is fp32, they are cast into a bf16 buffer, the masters'
``.grad``, before the unscale (as stock casts its fp32 partition to its bf16 master's dtype after the norm).

Example: group 0 owns ``a`` (6 elements) and ``b`` (4), both counted: its buffer is ``[a | b]``, 10 elements;
a bucket's segment ``[b[0:2] | a[0:6]]`` is added into views ``buffer[6:8]`` and ``buffer[0:6]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ds_tensorshard.datapath.buckets import Segment
from ds_tensorshard.datapath.host import HostMemory
from ds_tensorshard.datapath.host_worker import HostWorker
from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.datapath.shapes import numel_of, shape_of

NORM_CHUNK = 1 << 20  # elements cast to fp64 at a time for the gradient norm (8 MiB)


def block_shape(param: torch.nn.Parameter, block: Block) -> tuple[int, ...]:
    """The shape of ``param``'s dim-0 block ``block`` (the whole tensor's shape where it is whole; flat where the
    block is not whole rows, as a flat plan's may be)."""
    shape = shape_of(param)
    if block.numel == numel_of(param):
        return shape
    row = max(math.prod(shape[1:]), 1)
    if block.start % row or block.numel % row:
        return (block.numel,)
    return (block.numel // row, *shape[1:])


@dataclass
class Section:
    """One flat gradient buffer: a param group's owned tensors kept in one place, ``offset`` of each block."""

    group: int
    on_host: bool  # ZeRO-Offload's host memory (on a CPU-only machine the same memory: copies still made, counted)
    buffer: torch.Tensor  # in the accumulation dtype
    step: torch.Tensor  # the norm's dtype: the buffer itself, or what it is cast into at the step
    grad: torch.Tensor  # the masters' dtype (their .grad): ``step``, or what it is cast into before the unscale
    offset: dict[torch.nn.Parameter, int] = field(default_factory=dict)
    counted: int = 0  # elements of the tensors the norm counts (the first ones)


class OwnedGradients:
    """The reduced gradients of ``blocks`` (an owned block per parameter), ``group_of`` each, ``counted`` by the
    norm or not, in ``accum_dtype``: on ``device``, or in host memory with ``host`` (ZeRO-Offload) but for the
    ``separate`` ones (DeepSpeed's Muon matrices), which have buffers of their own on ``device``."""

    def __init__(
        self,
        blocks: dict[torch.nn.Parameter, Block],
        group_of: dict[torch.nn.Parameter, int],
        counted: Callable[[torch.nn.Parameter], bool],
        accum_dtype: torch.dtype,
        device: torch.device,
        host: HostMemory | None,
        separate: set[torch.nn.Parameter],
        master_dtype: torch.dtype = torch.float32,
        keeps: bool = False,
    ) -> None:
        self.blocks, self.host, self.accum_dtype, self.device = blocks, host, accum_dtype, device
        # stage 3: a tensor's gradient stays until a backward brings it another (stock ZeRO-3 never zeroes its
        # gradient partitions), so the step's unscale and clip work on a copy (:meth:`zero`, :meth:`restart`)
        self.keeps = keeps
        self.master_dtype, self.step_dtype = master_dtype, torch.promote_types(accum_dtype, master_dtype)
        self.narrowed = False  # the step's gradients cast into the masters' dtype (where that is narrower)
        # stage 3 with ZeRO-Offload: the tensors whose gradient stock leaves off its host buffer this step keep their
        # step gradient, the last one clipped, and the norm leaves them out (:meth:`hold`); per section (by id) the
        # ranges of the others, where any is held
        self.unheld: dict[int, list[tuple[int, int]]] = {}
        self.accumulated = False  # a gradient was added or set since the last zero()
        self.worker = HostWorker(device) if host is not None else None  # the host's adds, off the autograd thread
        self.sections: list[Section] = []
        self.section_of: dict[torch.nn.Parameter, Section] = {}
        self._segments: dict[int, tuple[Segment, list[torch.Tensor], list[int], list[bool]]] = {}  # made once
        self._step_views: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._master_views: dict[torch.nn.Parameter, torch.Tensor] = {}
        for group in sorted(set(group_of.values())):
            for kind in (False, True):  # the group's tensors, then its Muon matrices (``separate``)
                params = [p for p in blocks if group_of[p] == group and (p in separate) == kind]
                params.sort(key=lambda p: not counted(p))  # counted first (a stable sort keeps the order)
                if params:
                    self._add_section(group, params, counted, host is not None and not kind)

    def _add_section(
        self, group: int, params: list[torch.nn.Parameter], counted: Callable[[torch.nn.Parameter], bool], host: bool
    ) -> None:
        total = sum(self.blocks[p].numel for p in params)
        buffer = self._zeros(total, self.accum_dtype, host)
        apart = buffer.dtype != self.step_dtype or self.keeps
        step = self._zeros(total, self.step_dtype, host) if apart else buffer
        grad = step if step.dtype == self.master_dtype else self._zeros(total, self.master_dtype, host)
        section = Section(group, host, buffer, step, grad)
        offset = 0
        for param in params:
            section.offset[param] = offset
            offset += self.blocks[param].numel
            section.counted += self.blocks[param].numel if counted(param) else 0
            self.section_of[param] = section
        self.sections.append(section)

    def _zeros(self, numel: int, dtype: torch.dtype = torch.float32, host: bool = False) -> torch.Tensor:
        """A zeroed buffer on the device, or allocated pinned in host memory (ZeRO-Offload)."""
        if host:
            assert self.host is not None, "host buffers only with ZeRO-Offload"
            return self.host.zeros((numel,), dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def view(self, param: torch.nn.Parameter, step: bool = False) -> torch.Tensor:
        """``param``'s block of the accumulated gradient (``step``: of the step's fp32 gradient, a view made once,
        which the master keeps as ``.grad``), shaped as the block."""
        if step and param in self._step_views:
            return self._step_views[param]
        section = self.section_of[param]
        block, start = self.blocks[param], section.offset[param]
        view = (section.step if step else section.buffer)[start : start + block.numel].view(block_shape(param, block))
        if step:
            self._step_views[param] = view
        return view

    def master_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s block of the step's gradient in the masters' dtype (the master's ``.grad``), made once."""
        if self.section_of[param].grad is self.section_of[param].step:
            return self.view(param, step=True)
        view = self._master_views.get(param)
        if view is None:
            section, block = self.section_of[param], self.blocks[param]
            start = section.offset[param]
            view = section.grad[start : start + block.numel].view(block_shape(param, block))
            self._master_views[param] = view
        return view

    def hold(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Of the owned ``params`` (given each step): their step gradients stay as the last step left them, unscaled
        and clipped, and the norm leaves them out. Stock ZeRO-3 with ZeRO-Offload copies to its host gradient only
        what a step's last backward reduced (any backward's, unmanaged), clips that buffer in place and sums the norm
        of what it copied: the others are these."""
        held = {p for p in params if p in self.section_of}
        self.unheld = {id(s): _unheld_runs(s, held, self.blocks) for s in self.sections} if held else {}

    @torch.no_grad()
    def narrow(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """The step's gradients cast into the masters' dtype where it is narrower (bf16 masters, fp32
        accumulation): of every buffer once per step, or of ``params`` alone (an early update, before the whole
        step's)."""
        if self.narrowed:
            return
        if params is not None:
            for param in params:
                if self.section_of[param].grad is not self.section_of[param].step:
                    self.master_view(param).copy_(self.view(param, step=True))
            return
        self.narrowed = True
        for section in self.sections:
            if section.grad is not section.step:
                _copy_unheld(section.step, section.grad, self.unheld.get(id(section)))

    def _destinations(self, segment: Segment) -> tuple[list[torch.Tensor], list[int], list[bool]]:
        """The buffer views a segment's pieces are added into, the pieces' sizes and whether each is kept in host
        memory (made once per segment)."""
        cached = self._segments.get(id(segment))
        if cached is None:
            views, on_host = [], []
            for piece in segment.pieces:
                section, block = self.section_of[piece.param], self.blocks[piece.param]
                start = section.offset[piece.param] + piece.start - block.start
                views.append(section.buffer[start : start + piece.numel])
                on_host.append(section.on_host)
            sizes = [piece.numel for piece in segment.pieces]
            cached = self._segments[id(segment)] = (segment, views, sizes, on_host)
        return cached[1], cached[2], cached[3]

    @torch.no_grad()
    def accept(self, segment: Segment, reduced: torch.Tensor) -> None:
        """Add this rank's reduced ``segment`` (its pieces back to back in ``reduced``) to the gradients: one
        multi-tensor add per place the pieces are kept. With ZeRO-Offload the segment (or each host piece beside
        a Muon matrix kept on the device) crosses to pinned host memory without blocking, and the worker adds it
        there once the copy is done."""
        views, sizes, on_host = self._destinations(segment)
        self.accumulated = True
        if not any(on_host):
            _add(views, reduced, sizes, self.accum_dtype)
            return
        assert self.host is not None and self.worker is not None, "host buffers only with ZeRO-Offload"
        if all(on_host):  # the whole segment crosses once
            staged, event = self.host.stage(reduced)
            self.worker.submit(lambda: _add(views, staged, sizes, self.accum_dtype), event)
            return
        parts = reduced.split(sizes)  # Muon matrices kept on the device beside host pieces
        near = [(view, part) for view, part, far in zip(views, parts, on_host) if not far]
        torch._foreach_add_([view for view, _ in near], [part.to(self.accum_dtype) for _, part in near])
        for view, part, far in zip(views, parts, on_host):
            if far:
                staged, event = self.host.stage(part)
                self.worker.submit(functools.partial(_add, [view], staged, [view.numel()], self.accum_dtype), event)

    def settle(self) -> None:
        """The host's adds given so far are done (before the host buffers are read)."""
        if self.worker is not None:
            self.worker.settle()

    def set(self, param: torch.nn.Parameter, value: torch.Tensor, step: bool) -> None:
        """Set ``param``'s block of the accumulated (or, ``step``, the step's fp32) gradient to ``value``."""
        self.settle()
        self.accumulated = True
        self.view(param, step).view(-1).copy_(value.reshape(-1))

    @torch.no_grad()
    def to_step(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """The step's fp32 gradients from the accumulated ones: of every tensor (one cast per buffer that is not
        fp32 already), or of ``params`` alone (an early update, on the host worker)."""
        if params is None:
            self.settle()
            for section in self.sections:
                if section.step is not section.buffer:
                    _copy_unheld(section.buffer, section.step, self.unheld.get(id(section)))
            return
        for param in params:
            if self.section_of[param].step is not self.section_of[param].buffer:
                self.view(param, step=True).copy_(self.view(param))

    @torch.no_grad()
    def squares(self, groups: int, far: torch.device) -> torch.Tensor:
        """Per param group, the sum of squares of the counted tensors' step gradients in fp64 (as stock), a
        chunk of :data:`NORM_CHUNK` elements at a time (no fp64 copy of a whole buffer), each buffer's chunks in
        order; the buffers' sums added in order where the first buffer is (with ZeRO-Offload, those of the
        Muon matrices' buffers brought to the host together first). Returned on ``far`` (where the sum over
        ranks is made)."""
        sums = [(s.group, s.on_host, _squares_unheld(s, self.unheld.get(id(s)))) for s in self.sections]
        if not sums:
            return torch.zeros(groups, dtype=torch.float64, device=far)
        home = sums[0][2].device
        if self.host is not None and any(not on_host for _, on_host, _ in sums):
            fetched = iter(self.host.fetch(torch.stack([s for _, on_host, s in sums if not on_host])).unbind())
            sums = [(group, True, s if on_host else next(fetched)) for group, on_host, s in sums]
            home = torch.device("cpu")
        totals = torch.zeros(groups, dtype=torch.float64, device=home)
        for group, _, value in sums:
            totals[group] += value
        return totals.to(far)

    @torch.no_grad()
    def scale(self, factor: float | torch.Tensor) -> None:
        """Multiply every step gradient (in the masters' dtype) by ``factor``: once per buffer; a factor computed
        on the accelerator is copied once to the host for the host's buffers (a device scalar cannot enter a
        host kernel)."""
        self.narrow()
        copies: dict[torch.device, float | torch.Tensor] = {}
        for section in self.sections:
            where = section.grad.device
            if where not in copies:
                copies[where] = factor.to(where) if isinstance(factor, torch.Tensor) else factor
            section.grad.mul_(copies[where])

    @torch.no_grad()
    def zero(self) -> None:
        """The step is done: the accumulation starts again from zero (``keeps``: each gradient stays as it is until
        :meth:`restart` clears it for a new one)."""
        self.settle()
        self.narrowed = self.accumulated = False
        if not self.keeps:
            for section in self.sections:
                section.buffer.zero_()

    @torch.no_grad()
    def restart(self, segment: Segment, arrived: Callable[[torch.nn.Parameter], bool]) -> None:
        """Before ``segment`` is added: clear the pieces of the tensors that ``arrived`` (whose gradients the
        backward brought), so that these take the new gradient alone (stock ZeRO-3's copy at its micro-step 0)."""
        self.settle()
        views, _, _ = self._destinations(segment)
        for view, piece in zip(views, segment.pieces):
            if arrived(piece.param):
                view.zero_()

    def move(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The buffers to where ``moved`` puts them (``offload_states`` of ``lp_grads``); views are remade."""
        self.settle()
        for section in self.sections:
            step_apart, grad_apart = section.step is not section.buffer, section.grad is not section.step
            section.buffer = moved(section.buffer)
            section.step = moved(section.step) if step_apart else section.buffer
            section.grad = moved(section.grad) if grad_apart else section.step
        self._segments.clear()
        self._step_views.clear()
        self._master_views.clear()


def _unheld_runs(
    section: Section, held: set[torch.nn.Parameter], blocks: dict[torch.nn.Parameter, Block]
) -> list[tuple[int, int]]:
    """The ranges of ``section`` that hold no ``held`` tensor, as ``(start, stop)``, adjacent ones merged."""
    runs: list[tuple[int, int]] = []
    for param, start in section.offset.items():  # in buffer order
        if param in held:
            continue
        until = start + blocks[param].numel
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], until)
        else:
            runs.append((start, until))
    return runs


def _copy_unheld(source: torch.Tensor, target: torch.Tensor, runs: list[tuple[int, int]] | None) -> None:
    """``target`` from ``source``: whole, or only the ``runs`` (a section's ranges where some tensor is held)."""
    if runs is None:
        target.copy_(source)
        return
    for start, stop in runs:
        target[start:stop].copy_(source[start:stop])


def _squares_unheld(section: Section, runs: list[tuple[int, int]] | None) -> torch.Tensor:
    """The fp64 sum of squares of ``section``'s counted step gradients, only the ``runs`` of them where given."""
    if runs is None:
        return _sum_of_squares(section.step[: section.counted])
    total = torch.zeros((), dtype=torch.float64, device=section.step.device)
    for start, stop in runs:
        if start < section.counted:
            total += _sum_of_squares(section.step[start : min(stop, section.counted)])
    return total


def _add(views: list[torch.Tensor], reduced: torch.Tensor, sizes: list[int], dtype: torch.dtype) -> None:
    """``views`` += the parts of ``reduced`` (cast to ``dtype`` once): one multi-tensor add."""
    torch._foreach_add_(views, list((reduced if reduced.dtype == dtype else reduced.to(dtype)).split(sizes)))


def _sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``flat`` in fp64, a chunk at a time through one reused fp64 buffer (a fresh 8 MiB copy
    per chunk would leave holes that the small tensors made in between split, and the host heap would grow by a
    chunk each time)."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    if flat.numel() == 0:
        return total
    wide = torch.empty(min(flat.numel(), NORM_CHUNK), dtype=torch.float64, device=flat.device)
    for chunk in flat.split(NORM_CHUNK):
        part = wide[: chunk.numel()].copy_(chunk)
        total += torch.dot(part, part)
    return total
