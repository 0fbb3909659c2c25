"""``engine.coalesce_grad_reduction()`` (DeepSpeed 0.19.2) on a ds_tensorshard engine, as on stock ZeRO-1/2/3.

Stock's engine runs the block itself, unchanged here: it checks its preconditions, sets ``inside_no_sync_ctxt`` and
the optimizer's ``_coalesce_grad_reduction`` for the block, so that every backward inside it leaves its gradients
local (accumulating in the model; at stage 1 with a wider ``grad_accum_dtype``, held in that dtype), and on exit sets
the accumulation boundary and calls its ZeRO-1/2 or ZeRO-3 flush. That flush drives stock ZeRO's own buckets; on a
ds_tensorshard engine it is :meth:`CoalesceMethods.flush_coalesced_reduction`: every gradient of the block reduced
once onto its owner, as one boundary backward's would be. One block is one optimizer step, as in stock.

Where stock's engine would build ``BF16_Optimizer`` (bf16, ``grad_accum_dtype`` fp32, stage 1, no offload), stock
refuses the block (``NotImplementedError``); so does ds_tensorshard (:func:`stock_refusal`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


def stock_refusal(engine: DeepSpeedEngine) -> str | None:
    """Why stock refuses ``coalesce_grad_reduction()`` for this engine's config where ds_tensorshard has replaced
    the optimizer stock would have built, or None. Stock builds BF16_Optimizer (engine
    ``_do_optimizer_sanity_check``) for bf16 with fp32 gradient accumulation at stage 1 without offload, and
    BF16_Optimizer has no coalesced reduction."""
    model_dtype, accum_dtype = engine.get_data_types()[:2]
    if (
        model_dtype == torch.bfloat16
        and accum_dtype == torch.float32
        and engine.zero_optimization_stage() == 1
        and not engine.zero_cpu_offload()
    ):
        return (
            "coalesce_grad_reduction does not yet support optimizer wrapper BF16_Optimizer (stock DeepSpeed's "
            "optimizer for ZeRO stage 1 with bf16 and 'data_types.grad_accum_dtype' fp32, which ds_tensorshard "
            "replaces; stock refuses the call there, and so does ds_tensorshard)"
        )
    return None


class CoalesceMethods:
    """What stock's ``coalesce_grad_reduction()`` needs of a ZeRO optimizer (a mixin of TensorShardOptimizer)."""

    # set by the engine's coalesce_grad_reduction() for the block: the gradient hooks hand nothing to the reducer
    _coalesce_grad_reduction: bool = False
    domains: dict[str, Any]
    intake: Any

    @torch.no_grad()
    def flush_coalesced_reduction(self) -> None:
        """The block's exit, at the accumulation boundary the engine has set: every gradient the block's backwards
        accumulated is reduced onto its owner, in bucket order, then completed as after a boundary backward."""
        for domain in self.domains.values():
            reducer = domain.reducer
            for param in dict.fromkeys(p for bucket in reducer.buckets for p in bucket.params):
                if self.intake.gradient_of(param) is not None:
                    reducer.gradient_ready(param)
        self.overlapping_partition_gradients_reduce_epilogue()  # type: ignore[attr-defined]
