"""The reductions DeepSpeed's engine asks a ZeRO-1/2 optimizer for (a mixin of
:class:`~ds_tensorshard.TensorShardOptimizer`): stage 1's at the accumulation boundary, stage 2's after every
backward, each completing every domain's reducer; and the engine's accumulation boundary as the optimizer reads it."""

from __future__ import annotations

from typing import Any

import torch

from ds_tensorshard.phase import Phase


class ReduceMethods:
    """``reduce_gradients``, ``overlapping_partition_gradients_reduce_epilogue`` and
    ``finalize_gradient_accumulation_boundary``, as the engine calls them."""

    domains: dict[str, Any]
    phase: Phase
    reduce_in_background: bool  # initialize_many: the last reductions complete during the next model's backward
    is_gradient_accumulation_boundary: Any  # set by the engine

    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        """Stage 1, at the accumulation boundary: average every gradient onto its owner."""
        self._reduce_to_owners()

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        """Stage 2, after every backward: average onto owners, who accumulate in fp32."""
        self._reduce_to_owners()

    def finalize_gradient_accumulation_boundary(self) -> None:
        """Stage 2 with caller-managed accumulation: every micro-step was already reduced; nothing is pending."""
        self.phase = Phase.REDUCED

    @torch.no_grad()
    def _reduce_to_owners(self) -> None:
        for domain in self.domains.values():
            domain.reducer.finish(wait=not self.reduce_in_background)
        self.phase = Phase.REDUCED if self._at_boundary() else self.phase

    def _at_boundary(self) -> bool:
        """The engine's accumulation boundary: a method with a setter since DeepSpeed 0.19.6, a plain
        attribute the engine assigns before that."""
        flag = self.is_gradient_accumulation_boundary
        return bool(flag() if callable(flag) else flag)
