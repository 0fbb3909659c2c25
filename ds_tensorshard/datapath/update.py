"""Update: master copies and the inner optimizer, for owned tensors only.

A rank owns whole tensors, and at most one block (whole dim-0 rows) of each tensor the plan split.
Masters are contiguous fp32 tensors (bf16 with ``bf16_master_weights_and_grads``; CPU FusedAdam silently
skips non-contiguous ones): the model's own contiguous tensor (or its block, a view) where it has the
masters' dtype, else a copy. Each param group of the inner
optimizer keeps its dict (hyper-parameters, scheduler links) and gets only this rank's masters as
``params``, so optimizer state is created for owned tensors alone. The reduced gradients are kept in flat
buffers (:mod:`~ds_tensorshard.datapath.gradients`) whose fp32 views are the masters' ``.grad`` for good.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ds_tensorshard.datapath.adam_lists import AdamLists
from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.gradients import OwnedGradients, block_shape
from ds_tensorshard.datapath.host import HostMemory
from ds_tensorshard.datapath.muon_offload import DeviceMuon, device_matrices
from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.datapath.shapes import numel_of


class OwnedShard:
    """The tensors (or blocks) a rank owns: masters in ``master_dtype`` (fp32; bf16 with DeepSpeed's
    ``bf16_master_weights_and_grads``, :mod:`~ds_tensorshard.datapath.precision`), and their reduced
    gradients (``grads``).

    ``accum_dtype`` is DeepSpeed's gradient-accumulation dtype (``data_types.grad_accum_dtype``,
    else the model dtype), as stock ZeRO-2 uses; gradients take the masters' dtype when the step begins. With ``host``
    (ZeRO-Offload, :mod:`~ds_tensorshard.datapath.host`) the masters are host copies, each reduced gradient
    segment is accumulated on the host as it arrives, and the inner optimizer's state is made there; except
    for Muon's matrices (:mod:`~ds_tensorshard.datapath.muon_offload`), whose gradients stay on ``device``,
    orthogonalized there at their update. ``counted(param)``: whether the norm counts it. ``keeps`` (stage 3): a
    gradient stays until a backward brings another (:class:`~ds_tensorshard.datapath.gradients.OwnedGradients`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        owned_by_group: list[list[tuple[torch.nn.Parameter, Block]]],
        accum_dtype: torch.dtype,
        device: torch.device,
        host: HostMemory | None = None,
        counted: Callable[[torch.nn.Parameter], bool] = lambda p: True,
        master_dtype: torch.dtype = torch.float32,
        storage: Callable[[torch.nn.Parameter, Block], torch.Tensor] | None = None,
        keeps: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.storage = storage or model_block  # where the model keeps an owned block (stage 3: its ds_tensor)
        self.master_dtype = master_dtype  # bf16 with bf16_master_weights_and_grads (datapath/precision.py)
        self.device = device
        self.host = host
        self.accum_dtype = accum_dtype
        self.blocks: dict[torch.nn.Parameter, Block] = {}
        self.masters: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.group_of: dict[torch.nn.Parameter, int] = {}
        self.views: set[torch.nn.Parameter] = set()  # params whose master is a view of their own (fp32) tensor
        self.stepped: set[torch.nn.Parameter] = set()  # updated early in this step (datapath.early_update)
        matrices = device_matrices(optimizer)
        self.on_device = matrices if host is not None else set()  # then this rank's only
        self.muon = DeviceMuon(optimizer, host, device) if host is not None and self.on_device else None
        for g, (group, owned) in enumerate(zip(optimizer.param_groups, owned_by_group)):
            masters = []
            for param, block in owned:
                own = self.storage(param, block).view(block_shape(param, block))
                if host is not None:
                    master = host.fetch(own, master_dtype)
                elif param.dtype == master_dtype and own.device == device:
                    master = own  # the model's own tensor (block) serves as the master: no second copy
                    self.views.add(param)
                else:  # (stage 3's offload_param keeps the model's tensors in host memory)
                    master = own.to(device=device, dtype=master_dtype, copy=True)
                self.blocks[param] = block
                self.masters[param] = master
                self.group_of[param] = g
                masters.append(master)
            group["params"] = masters
        self.on_device &= self.masters.keys()
        separate = matrices & self.masters.keys()
        self.grads = OwnedGradients(
            self.blocks, self.group_of, counted, accum_dtype, device, host, separate, master_dtype, keeps
        )
        self.attach_grads()  # a Muon matrix's (on_device) is lent at its update
        self._own_views: dict[torch.nn.Parameter, tuple[tuple[int, int], torch.Tensor, torch.Tensor]] = {}
        fp32 = master_dtype == torch.float32
        self._adam = AdamLists(optimizer) if fp32 and AdamLists.applies(optimizer) else None  # lists made once

    def is_whole(self, param: torch.nn.Parameter) -> bool:
        return self.blocks[param].numel == numel_of(param)

    @torch.no_grad()
    def accept(self, bucket: Bucket, segment: torch.Tensor, rank: int) -> None:
        """A reduced segment of ``bucket`` arrived at its owner, this ``rank``: add it to the gradients."""
        owned = bucket.segment_of(rank)
        assert owned is not None, "a segment is delivered only to its owner"
        self.grads.accept(owned, segment)

    def gradients_to_masters(self) -> None:
        """The step's fp32 gradients (the masters' ``.grad``) from the accumulated ones."""
        self.grads.to_step()

    def step_gradient(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The step's gradient of an owned ``param`` (once the step began; fp32, or bf16 for bf16 masters with bf16
        accumulation: the norm's), where it is kept."""
        return self.grads.view(param, step=True)

    @torch.no_grad()
    def squared_grad_norms(self) -> torch.Tensor:
        """Per param group, the sum of squares of this rank's step gradients of the tensors the norm counts, in
        fp64 (as stock; :meth:`OwnedGradients.squares`), on the device."""
        return self.grads.squares(len(self.optimizer.param_groups), self.device)

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply every step gradient by ``factor`` (once per gradient buffer)."""
        self.grads.scale(factor)

    @torch.no_grad()
    def step(self, early: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Run the inner optimizer on the masters, then write them into the model's tensors: all of them not yet
        updated in this step; or, ``early``, those tensors at once, their reduced gradients complete."""
        todo = [p for p in (self.masters if early is None else early) if p not in self.stepped]
        if early is not None:
            self.grads.to_step(todo)
            self.update(todo, keep_grads=True)
            return
        self.grads.narrow()
        if not self.stepped and not self.on_device:
            self._adam.step() if self._adam is not None else self.optimizer.step()
        elif todo:
            self._step_only(todo)
        align_step_counts(self.optimizer)
        self._write_back(todo)

    @torch.no_grad()
    def update(self, params: list[torch.nn.Parameter], keep_grads: bool = False) -> None:
        """The inner optimizer on the masters of ``params`` alone (their gradients in place), each written into
        the model's tensor and counted as updated in this step. Exact only for an inner optimizer that counts
        steps per tensor (DeepSpeed's CPU optimizers, torch's), as ZeRO-Offload's are. ``keep_grads``: an early
        update, before the norm: the gradients kept on the device are left as they are for it."""
        if params:
            self.grads.narrow(params)
            self._step_only(params, keep_grads)
            self.stepped.update(params)
            self._write_back(params)

    def not_updated_in(self, bucket: Bucket, rank: int) -> list[torch.nn.Parameter]:
        """This ``rank``'s tensors with a piece in ``bucket`` that this step has not updated yet."""
        mine = bucket.segment_of(rank)
        params = () if mine is None else dict.fromkeys(piece.param for piece in mine.pieces)
        return [p for p in params if p not in self.stepped]

    def _write_back(self, params: list[torch.nn.Parameter]) -> None:
        """The updated masters of ``params`` into the model's tensors (an fp32 model's own storage needs nothing):
        one multi-tensor copy on the device; with ZeRO-Offload each cast on the host and sent."""
        targets = [param for param in params if param not in self.views]
        if self.host is not None:
            for param in targets:
                self.host.send(self.masters[param], self._own_view(param))
        elif targets:
            pairs = [self._flat_pair(param) for param in targets]
            torch._foreach_copy_([own for own, _ in pairs], [master for _, master in pairs])

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
        grad = self.grads.view(param, step=True)  # the Muon matrix's, kept on the device
        group = self.optimizer.param_groups[self.group_of[param]]
        return self.muon.pre_orthogonalized(master, group, grad.clone() if keep_grad else grad)

    def relink_views(self) -> None:
        """After the model's tensors moved (offload, reload): the masters that are views follow them. Each is
        a new view (in the inner optimizer's group and state too): one relinked in place (``.data``) would keep
        the tensor it was a view of, and so the memory the move was to free."""
        for param in self.views:
            self._replace_master(param, self._own(param).view(self.masters[param].shape))
        self.attach_grads()

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
        if master.grad is not None and master.grad.device == new.device:
            new.grad = master.grad
        group = self.optimizer.param_groups[self.group_of[param]]["params"]
        group[next(i for i, m in enumerate(group) if m is master)] = new
        if master in self.optimizer.state:
            self.optimizer.state[new] = self.optimizer.state.pop(master)
        self.masters[param] = new

    def _own(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self.storage(param, self.blocks[param])

    def _own_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """:meth:`_own`, made once and again only where the model's tensor moved (its storage changed)."""
        return self._flat_pair(param)[0]

    def _flat_pair(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat views of the model's tensor (block) and of its master, made once and again only where either
        changed (the model's storage moved, the master was replaced)."""
        master = self.masters[param]
        cached = self._own_views.get(param)
        if cached is None or cached[0] != (param.data_ptr(), id(master)):
            cached = self._own_views[param] = ((param.data_ptr(), id(master)), self._own(param), master.view(-1))
        return cached[1], cached[2]

    def move_grads(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The gradient buffers to where ``moved`` puts them (``offload_states``), the masters' views with them."""
        self.grads.move(moved)
        self.attach_grads()

    def forget_views(self) -> None:
        """Drop the views and lists made once of the model's tensors, masters and state (they moved: kept, the
        views would keep the memory the move was to free)."""
        self._own_views.clear()
        if self._adam is not None:
            self._adam.forget()

    def attach_grads(self) -> None:
        """Each master's ``.grad`` is its view of the step gradients where both are on one device; while
        ``offload_states`` keeps them apart (one moved, not the other), none: reloaded, the views come back."""
        for param, master in self.masters.items():
            if param not in self.on_device:
                grad = self.grads.master_view(param)
                master.grad = grad if grad.device == master.device else None

    def drop_grads(self) -> None:
        """The step's gradients are used (or skipped): accumulate the next step's from zero."""
        self.grads.zero()
        self.stepped.clear()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Every master into the model's tensor (block) it is the master of, as after an update."""
        self._write_back(list(self.masters))

    @torch.no_grad()
    def reload_from_params(self) -> None:
        """Refresh masters from the (possibly newly loaded) model tensors."""
        for param, master in self.masters.items():
            own = self._own(param)
            if master.data_ptr() != own.data_ptr():
                master.view(-1).copy_(own)


def model_block(param: torch.nn.Parameter, block: Block) -> torch.Tensor:
    """Where the model keeps ``param``'s owned ``block`` at stages 1/2: a flat view of the parameter's own tensor."""
    return param.data.view(-1)[block.start : block.stop]


def align_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """FusedAdam advances an int ``step`` on a group's last tensor only; give every tensor the group's count."""
    state = optimizer.state
    for group in optimizer.param_groups:
        stepped = [m for m in group["params"] if "step" in state.get(m, {})]
        steps = [state[m]["step"] for m in stepped]
        if steps and all(isinstance(step, int) for step in steps):
            count = max(steps)
            for master in stepped:
                state[master]["step"] = count
