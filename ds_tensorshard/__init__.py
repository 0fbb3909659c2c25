"""ds_tensorshard: tensor-granular ZeRO-1/2 for DeepSpeed. ``import ds_tensorshard`` registers it."""

import deepspeed as _deepspeed

from .versions import check_deepspeed_version

check_deepspeed_version(_deepspeed.__version__)

from .config import TensorShardConfig, TensorShardConfigError  # noqa: E402
from .engine_hooks import install, installed  # noqa: E402
from .many import initialize_many, step_many  # noqa: E402
from .optimizer import TensorShardOptimizer  # noqa: E402
from .plan import OwnershipPlan, plan_ownership  # noqa: E402

install()

__version__ = "0.1.0"
__all__ = [
    "TensorShardConfig",
    "TensorShardConfigError",
    "TensorShardOptimizer",
    "OwnershipPlan",
    "plan_ownership",
    "install",
    "installed",
    "initialize_many",
    "step_many",
]
