"""Where a gradient goes when backward produces it: into the reducer, or held until the accumulation boundary.

Stages 2 and 3 reduce after every backward; stage 1 only in the boundary's backward (outside ``engine.no_sync()``;
a PipelineEngine reduces once, at the end of the batch). Until then a stage-1 gradient accumulates in the
model, or, where ``grad_accum_dtype`` is wider than the model's dtype, held in that dtype here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

# a parameter's gradient hook, by id: a model given to a new engine drops the previous engine's hook
_HOOKS: dict[int, RemovableHandle] = {}


class GradientIntake:
    """The post-accumulate-grad hook of every sharded parameter, and the gradient each one hands on."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: dict[torch.nn.Parameter, str],
        reduces_now: Callable[[], bool],
        held_dtype: torch.dtype | None,
    ) -> None:
        self.names, self.reduces_now = names, reduces_now
        self.held_dtype = held_dtype
        self.held: dict[torch.nn.Parameter, torch.Tensor] | None = {} if held_dtype is not None else None
        self.to_reducer: Callable[[torch.nn.Parameter], None] = lambda param: None  # set by the optimizer
        self.check_caller: Callable[[], None] = lambda: None  # set by the optimizer: raises for a backward it refuses
        for param in params:
            previous = _HOOKS.pop(id(param), None)
            if previous is not None:
                previous.remove()
            else:
                weakref.finalize(param, _HOOKS.pop, id(param), None)
            _HOOKS[id(param)] = param.register_post_accumulate_grad_hook(self.ready)

    @classmethod
    def of(
        cls,
        engine: DeepSpeedEngine,
        params: list[torch.nn.Parameter],
        names: dict[torch.nn.Parameter, str],
        at_boundary: Callable[[], bool],
        coalescing: Callable[[], bool],
    ) -> GradientIntake:
        """The intake of an engine's ZeRO stage (see the module's account); ``coalescing``: inside the engine's
        ``coalesce_grad_reduction()`` block, whose backwards reduce nothing (:mod:`~ds_tensorshard.coalesce`)."""
        stage1 = engine.zero_optimization_stage() == 1
        pipeline = isinstance(engine, PipelineEngine)  # it runs backward itself and reduces once (as stock ZeRO-1)
        dtype, accum_dtype = engine.get_data_types()[:2]

        def reduces_now() -> bool:
            return not coalescing() and (
                not stage1 or (at_boundary() and not engine.inside_no_sync_ctxt and not pipeline)
            )

        return cls(params, names, reduces_now, accum_dtype if stage1 and accum_dtype != dtype else None)

    @torch.no_grad()
    def ready(self, param: torch.nn.Parameter) -> None:
        """The hook: in a backward that reduces, hand the gradient to the reducer (which starts complete
        buckets at once); otherwise let it accumulate, in the model or held here. A parameter marked
        ``ds_grad_is_ready = False`` accumulates too: DeepSpeed's tiled computations (``TiledMLP``,
        ``sequence_tiled_compute``, ``TiledFusedLogitsLoss``) run backward once per shard and mark all but the
        last, as stock ZeRO reduces only the gradient of the last (the sum)."""
        self.check_caller()
        reducing = self.reduces_now() and getattr(param, "ds_grad_is_ready", True)
        if self.held is not None and (param in self.held or not reducing):
            assert param.grad is not None, f"{self.names[param]}: hook called without a gradient"
            held = self.held.get(param)
            self.held[param] = param.grad.to(self.held_dtype) if held is None else held.add_(param.grad)
            param.grad = None
        if reducing:
            self.to_reducer(param)

    def gradient_of(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient to reduce: the held one (in ``grad_accum_dtype``), else the model's."""
        held = self.held.get(param) if self.held is not None else None
        return param.grad if held is None else held

    def release(self, param: torch.nn.Parameter) -> None:
        """A gradient is packed into its last bucket: neither the model nor this keeps it."""
        param.grad = None
        if self.held is not None:
            self.held.pop(param, None)

    def clear(self, params: list[torch.nn.Parameter], set_to_none: bool) -> None:
        """``zero_grad``: the model's gradients (and the held ones) to None, or to zeros, as stock."""
        for param in params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()
        if self.held is not None:
            if set_to_none:
                self.held.clear()
            else:
                for held in self.held.values():
                    held.zero_()
