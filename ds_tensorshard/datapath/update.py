"""Update: master copies, reduced gradients and the inner optimizer, for owned tensors only.

A rank owns whole tensors, and at most one block (whole dim-0 rows) of each tensor the plan split.
Masters are contiguous fp32 tensors (bf16 with ``bf16_master_weights_and_grads``; CPU FusedAdam silently
skips non-contiguous ones): the model's own contiguous tensor (or its block, a view) where it has the
masters' dtype, else a copy. Each param group of the inner
optimizer keeps its dict (hyper-parameters, scheduler links) and gets only this rank's masters as
``params``, so optimizer state is created for owned tensors alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from ds_tensorshard.datapath.buckets import Bucket, Piece
from ds_tensorshard.datapath.host import HostMemory
from ds_tensorshard.datapath.muon_offload import DeviceMuon, device_matrices
from ds_tensorshard.datapath.plan import Block

NORM_CHUNK = 1 << 20  # elements cast to fp64 at a time for the gradient norm (8 MiB)


def _block_shape(param: torch.nn.Parameter, block: Block) -> tuple[int, ...]:
    if block.numel == param.numel():
        return tuple(param.shape)
    return (block.numel // max(math.prod(param.shape[1:]), 1), *param.shape[1:])


def _widened(chunk: torch.Tensor, buffers: dict[torch.device, torch.Tensor]) -> torch.Tensor:
    """``chunk`` in fp64, written into one reused buffer per device: a fresh 8 MiB copy per chunk would leave
    holes that the small tensors made in between split, and the host heap would grow by a chunk each time."""
    buffer = buffers.get(chunk.device)
    if buffer is None or buffer.numel() < chunk.numel():
        buffer = buffers[chunk.device] = torch.empty(chunk.numel(), dtype=torch.float64, device=chunk.device)
    return buffer[: chunk.numel()].copy_(chunk)


class OwnedShard:
    """The tensors (or blocks) a rank owns: masters in ``master_dtype`` (fp32; bf16 with DeepSpeed's
    ``bf16_master_weights_and_grads``, :mod:`~ds_tensorshard.datapath.precision`), and reduced gradients
    accumulated in ``accum_dtype``.

    ``accum_dtype`` is DeepSpeed's gradient-accumulation dtype (``data_types.grad_accum_dtype``,
    else the model dtype), as stock ZeRO-2 uses; gradients take the masters' dtype when the step begins. With ``host``
    (ZeRO-Offload, :mod:`~ds_tensorshard.datapath.host`) the masters are host copies, each reduced gradient
    piece is accumulated on the host as it arrives, and the inner optimizer's state is made there; except
    for Muon's matrices (:mod:`~ds_tensorshard.datapath.muon_offload`), whose gradients stay on ``device``
    (in ``device_grads`` from the step's start), orthogonalized there at their update.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        owned_by_group: list[list[tuple[torch.nn.Parameter, Block]]],
        accum_dtype: torch.dtype,
        device: torch.device,
        host: HostMemory | None = None,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.optimizer = optimizer
        self.master_dtype = master_dtype  # bf16 with bf16_master_weights_and_grads (datapath/precision.py)
        self.device = device
        self.host = host
        self.accum_dtype = accum_dtype
        self.blocks: dict[torch.nn.Parameter, Block] = {}
        self.accumulated: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.masters: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.group_of: dict[torch.nn.Parameter, int] = {}
        self.views: set[torch.nn.Parameter] = set()  # params whose master is a view of their own (fp32) tensor
        self.stepped: set[torch.nn.Parameter] = set()  # updated early in this step (datapath.early_update)
        self.on_device = device_matrices(optimizer) if host is not None else set()  # then this rank's only
        self.muon = DeviceMuon(optimizer, host, device) if host is not None and self.on_device else None
        self.device_grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # the step's fp32 gradients of on_device
        self.wide_grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # fp32 gradients of bf16 masters, until unscaled
        for g, (group, owned) in enumerate(zip(optimizer.param_groups, owned_by_group)):
            masters = []
            for param, block in owned:
                own = param.detach().view(-1)[block.start : block.stop].view(_block_shape(param, block))
                if host is not None:
                    master = host.fetch(own, master_dtype)
                elif param.dtype == master_dtype:
                    master = own  # the model's own tensor (block) serves as the master: no second copy
                    self.views.add(param)
                else:
                    master = own.to(dtype=master_dtype, copy=True)
                self.blocks[param] = block
                self.masters[param] = master
                self.group_of[param] = g
                masters.append(master)
            group["params"] = masters
        self.on_device &= self.masters.keys()

    def is_whole(self, param: torch.nn.Parameter) -> bool:
        return self.blocks[param].numel == param.numel()

    @torch.no_grad()
    def accept(self, bucket: Bucket, segment: torch.Tensor, rank: int) -> None:
        """A reduced segment of ``bucket`` arrived at its owner, this ``rank``: accumulate each piece."""
        owned = bucket.segment_of(rank)
        assert owned is not None, "a segment is delivered only to its owner"
        for piece, grad in owned.views(segment):
            self.accumulate(piece, grad)

    def accumulate(self, piece: Piece, grad: torch.Tensor) -> None:
        """Add a reduced gradient piece of an owned tensor to its accumulator."""
        block = self.blocks[piece.param]
        total = self.accumulated.get(piece.param)
        if self.host is not None and piece.param not in self.on_device:
            grad = self.host.fetch(grad)
        if total is None:
            if piece.numel == block.numel:  # the whole block at once: keep (a copy of) it
                self.accumulated[piece.param] = grad.to(self.accum_dtype, copy=grad.dtype != self.accum_dtype)
                return
            total = self.accumulated[piece.param] = torch.zeros(block.numel, dtype=self.accum_dtype, device=grad.device)
        total[piece.start - block.start : piece.stop - block.start].add_(grad)

    def gradients_to_masters(self) -> None:
        """Hand the accumulated gradients to the masters as fp32 (zeros for tensors that got none), except to
        those already updated early, which have theirs."""
        for param in self.masters:
            if param not in self.stepped:
                self._gradient_to_master(param)

    def _gradient_to_master(self, param: torch.nn.Parameter) -> None:
        master, total = self.masters[param], self.accumulated.pop(param, None)
        if param in self.on_device:
            zeros = torch.zeros(master.shape, dtype=torch.float32, device=self.device)
            self.device_grads[param] = zeros if total is None else total.to(torch.float32).view(master.shape)
        else:
            dtype = torch.promote_types(self.accum_dtype, master.dtype)  # the norm's: bf16 masters, fp32 accumulation
            grad = torch.zeros(master.shape, dtype=dtype, device=master.device) if total is None else total.to(dtype)
            if dtype == master.dtype:
                master.grad = grad.view(master.shape)
            else:  # kept apart until the unscale: a tensor's .grad must have its dtype
                self.wide_grads[param] = grad.view(master.shape)

    def _grads_in_master_dtype(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Before the unscale-and-clip and the update: gradients wider than their (bf16) masters take the masters'
        dtype, as stock casts its flat gradient partition to its master partition's dtype after the norm."""
        for param in params:
            wide = self.wide_grads.pop(param, None)
            if wide is not None:
                self.masters[param].grad = wide.to(self.masters[param].dtype)

    def step_gradient(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The step's gradient of an owned ``param`` (once the step began; in the masters' dtype, or fp32 until the
        unscale for bf16 masters with fp32 accumulation), where it is kept."""
        if param in self.on_device:
            return self.device_grads.get(param)
        return self.wide_grads.get(param, self.masters[param].grad)

    @torch.no_grad()
    def squared_grad_norms(self, counted: Callable[[torch.nn.Parameter], bool] = lambda p: True) -> torch.Tensor:
        """Per param group, the sum of squares of this rank's master gradients of the ``counted`` tensors,
        in fp64 (as stock), a chunk at a time so that no fp64 copy of a whole tensor is made. Offloaded, the
        chunks' squares are summed on the host in the same order, those of gradients kept on the device
        brought over together first."""
        where = self.device if self.host is None else torch.device("cpu")
        totals = [torch.zeros((), dtype=torch.float64, device=where) for _ in self.optimizer.param_groups]
        squares: list[tuple[int, torch.Tensor, bool]] = []  # (group, square, computed on the device for the host)
        wide_buffers: dict[torch.device, torch.Tensor] = {}
        for param in self.masters:
            grad = self.step_gradient(param)
            if grad is not None and counted(param):
                flat = grad.reshape(-1)
                for chunk in flat.split(NORM_CHUNK) if flat.numel() > NORM_CHUNK else (flat,):
                    wide = _widened(chunk, wide_buffers)
                    squares.append((self.group_of[param], torch.dot(wide, wide), param in self.on_device))
        if self.host is not None and any(far for _, _, far in squares):
            fetched = iter(self.host.fetch(torch.stack([s for _, s, far in squares if far])).unbind())
            squares = [(g, next(fetched) if far else s, False) for g, s, far in squares]
        for group, square, _ in squares:
            totals[group].add_(square)
        return torch.stack(totals).to(self.device)

    @torch.no_grad()
    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply every step gradient by ``factor``, one multi-tensor operation per device: a factor computed on
        the accelerator is copied once to the host for the gradients kept there (ZeRO-Offload), since a
        device scalar cannot enter a host kernel."""
        self._grads_in_master_dtype(self.masters)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for param in self.masters:
            grad = self.step_gradient(param)
            if grad is not None:
                by_device.setdefault(grad.device, []).append(grad)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, factor.to(device) if isinstance(factor, torch.Tensor) else factor)

    @torch.no_grad()
    def step(self, early: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Run the inner optimizer on the masters, then write them into the model's tensors: all of them not yet
        updated in this step; or, ``early``, those tensors at once, their reduced gradients complete."""
        todo = [p for p in (self.masters if early is None else early) if p not in self.stepped]
        if early is not None:
            for param in todo:
                self._gradient_to_master(param)
            self.update(todo, keep_grads=True)
            return
        self._grads_in_master_dtype(todo)
        if not self.stepped and not self.on_device:
            self.optimizer.step()
        elif todo:
            self._step_only(todo)
        self._align_step_counts()
        self._write_back(todo)

    @torch.no_grad()
    def update(self, params: list[torch.nn.Parameter], keep_grads: bool = False) -> None:
        """The inner optimizer on the masters of ``params`` alone (their gradients in place), each written into
        the model's tensor and counted as updated in this step. Exact only for an inner optimizer that counts
        steps per tensor (DeepSpeed's CPU optimizers, torch's), as ZeRO-Offload's are. ``keep_grads``: an early
        update, before the norm: the gradients kept on the device are left as they are for it."""
        if params:
            self._grads_in_master_dtype(params)
            self._step_only(params, keep_grads)
            self.stepped.update(params)
            self._write_back(params)

    def not_updated_in(self, bucket: Bucket, rank: int) -> list[torch.nn.Parameter]:
        """This ``rank``'s tensors with a piece in ``bucket`` that this step has not updated yet."""
        mine = bucket.segment_of(rank)
        params = () if mine is None else dict.fromkeys(piece.param for piece in mine.pieces)
        return [p for p in params if p not in self.stepped]

    def _write_back(self, params: list[torch.nn.Parameter]) -> None:
        for param in params:
            master, own = self.masters[param], self._own(param)
            if self.host is not None:
                self.host.send(master, own)
            elif master.data_ptr() != own.data_ptr():
                own.copy_(master.view(-1))

    def _step_only(self, params: list[torch.nn.Parameter], keep_grads: bool = False) -> None:
        """The inner optimizer's step on the masters of ``params`` alone (each group keeps its dict). An
        offloaded Muon matrix is orthogonalized on the device first and stepped as a pre-orthogonalized view
        (:mod:`~ds_tensorshard.datapath.muon_offload`), from a copy of its gradient with ``keep_grads``."""
        chosen = {id(self.masters[p]): self._stepped_as(p, keep_grads) for p in params}
        groups = self.optimizer.param_groups
        kept = [group["params"] for group in groups]
        try:
            for group, masters in zip(groups, kept):
                group["params"] = [chosen[id(m)] for m in masters if id(m) in chosen]
            self.optimizer.step()
        finally:
            for group, masters in zip(groups, kept):
                group["params"] = masters

    def _stepped_as(self, param: torch.nn.Parameter, keep_grad: bool) -> torch.Tensor:
        """What the inner optimizer steps for ``param``: its master, or for an offloaded Muon matrix a view of it
        carrying the update made on the device from its gradient (consumed unless ``keep_grad``)."""
        master = self.masters[param]
        if param not in self.on_device:
            return master
        assert self.muon is not None, "matrices are kept on the device only with offload"
        grad = self.device_grads[param] if keep_grad else self.device_grads.pop(param)
        group = self.optimizer.param_groups[self.group_of[param]]
        return self.muon.pre_orthogonalized(master, group, grad.clone() if keep_grad else grad)

    def relink_views(self) -> None:
        """After the model's tensors moved (offload, reload): the masters that are views follow them. Each is
        a new view (in the inner optimizer's group and state too): one relinked in place (``.data``) would keep
        the tensor it was a view of, and so the memory the move was to free."""
        for param in self.views:
            self._replace_master(param, self._own(param).view(self.masters[param].shape))

    def separate_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The master of an owned ``param``, first made a tensor of its own where it is an fp32 model's own
        storage: a master set from outside then reaches the model at the next step only, as stock's does."""
        master = self.masters[param]
        if master.data_ptr() != self._own(param).data_ptr():
            return master
        self._replace_master(param, master.clone(memory_format=torch.contiguous_format))
        self.views.discard(param)  # no longer the model's storage: offloads leave it alone
        return self.masters[param]

    def _replace_master(self, param: torch.nn.Parameter, new: torch.Tensor) -> None:
        """``new`` becomes ``param``'s master everywhere the old one was: here, its param group, the optimizer's
        state; it takes over the gradient."""
        master = self.masters[param]
        new.grad = master.grad
        group = self.optimizer.param_groups[self.group_of[param]]["params"]
        group[next(i for i, m in enumerate(group) if m is master)] = new
        if master in self.optimizer.state:
            self.optimizer.state[new] = self.optimizer.state.pop(master)
        self.masters[param] = new

    def _own(self, param: torch.nn.Parameter) -> torch.Tensor:
        block = self.blocks[param]
        return param.data.view(-1)[block.start : block.stop]

    def _align_step_counts(self) -> None:
        """FusedAdam advances an int ``step`` on a group's last tensor only; give every tensor the group's count."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            stepped = [m for m in group["params"] if "step" in state.get(m, {})]
            steps = [state[m]["step"] for m in stepped]
            if steps and all(isinstance(step, int) for step in steps):
                count = max(steps)
                for master in stepped:
                    state[master]["step"] = count

    def drop_grads(self) -> None:
        self.accumulated.clear()
        self.device_grads.clear()
        self.wide_grads.clear()
        self.stepped.clear()
        for master in self.masters.values():
            master.grad = None

    @torch.no_grad()
    def reload_from_params(self) -> None:
        """Refresh masters from the (possibly newly loaded) model tensors."""
        for param, master in self.masters.items():
            own = self._own(param)
            if master.data_ptr() != own.data_ptr():
                master.view(-1).copy_(own)
