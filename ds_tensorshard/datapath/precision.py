"""The dtype of the owners' masters and reduced gradients: fp32, or bf16 with DeepSpeed's
``bf16.bf16_master_weights_and_grads`` (0.18.3), as stock ZeRO-1/2 keeps them.

Stock (``stage_1_and_2.py``, ``base_optimizer._configure_master_weights``), with the key: the master partition and
its gradient are bf16; the reduced gradient is cast to bf16 at the step, unscaled and clipped there, and the inner
optimizer steps the bf16 master, its state in the master's dtype (FusedAdam makes it like the parameter) or, with
ZeRO-Offload, as DeepSpeedCPUAdam keeps it (fp32, bf16 with ``bf16.bf16_optimizer_states``). ds_tensorshard does the
same per owned tensor; a bf16 model's own tensor (or block) serves as its owner's master, so there is no master copy.

Refused as stock's constructor refuses them (:class:`~ds_tensorshard.errors.RefusedAsStock`): bf16 masters without
ZeRO-Offload and DeepSpeedCPUAdam, unless ``bf16_optimizer_states`` is set without offload; offloaded bf16 optimizer
states from a DeepSpeedCPUAdam with fp32 states. Where stock's engine builds BF16_Optimizer instead of its ZeRO
optimizer (bf16 with fp32 gradient accumulation at stage 1, no offload), which keeps fp32 masters whatever these keys
say, ds_tensorshard keeps fp32 masters too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ds_tensorshard.errors import RefusedAsStock, TensorShardConfigError

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

# the inner optimizers stock builds for "Adam"/"AdamW" (FusedAdam; DeepSpeedCPUAdam with offload), the ones bf16
# masters have been matched with (tests/multiprocess/test_precision.py)
BF16_MASTER_OPTIMIZERS = frozenset({"FusedAdam", "DeepSpeedCPUAdam"})


def stock_builds_bf16_optimizer(engine: DeepSpeedEngine) -> bool:
    """Whether stock's engine sends this config to BF16_Optimizer rather than its ZeRO optimizer (engine
    ``_do_optimizer_sanity_check``): bf16 parameters, fp32 gradient accumulation, stage 1, no offload."""
    model_dtype, accum_dtype = engine.get_data_types()[:2]
    return (
        model_dtype == torch.bfloat16
        and accum_dtype == torch.float32
        and engine.zero_optimization_stage() == 1
        and not engine.zero_cpu_offload()
    )


def master_dtype(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer) -> torch.dtype:
    """The owners' master and gradient dtype for this engine, after stock's checks of the keys (DeepSpeed releases
    before 0.18.3 have neither key: fp32)."""
    bf16_masters = getattr(engine, "bf16_master_weights_and_gradients", lambda: False)()
    if not bf16_masters or stock_builds_bf16_optimizer(engine):
        return torch.float32
    states, offload, name = engine.bf16_optimizer_states(), engine.zero_cpu_offload(), type(optimizer).__name__
    if (not states or offload) and not (offload and name == "DeepSpeedCPUAdam"):
        stage = engine.zero_optimization_stage()
        raise RefusedAsStock(  # stock's message, from its ZeRO constructor
            f"'bf16.bf16_master_weights_and_grads': Master weights feature requires ZeRO-{stage} Offload with "
            f"DeepSpeedCPUAdam. Current ZeRO-Offload:{offload} optimizer type {type(optimizer)} (stock DeepSpeed "
            "refuses it too; without offload, set 'bf16.bf16_optimizer_states' as well)"
        )
    if states and offload and getattr(optimizer, "fp32_optimizer_states", True):
        raise RefusedAsStock(
            "'bf16.bf16_optimizer_states': bf16_optimizer_states with ZeRO-Offload requires DeepSpeedCPUAdam "
            "constructed with fp32_optimizer_states=False so optimizer moments are stored in bf16 (stock DeepSpeed "
            "refuses it too)"
        )
    if name not in BF16_MASTER_OPTIMIZERS:
        raise TensorShardConfigError(
            f"'bf16.bf16_master_weights_and_grads' with the inner optimizer {name} is not supported by ds_tensorshard: "
            "bf16 masters have been matched with stock's Adam/AdamW only (FusedAdam, DeepSpeedCPUAdam); remove the "
            "key or use the 'Adam'/'AdamW' optimizer type"
        )
    return torch.bfloat16
