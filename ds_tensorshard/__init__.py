"""ds_tensorshard: tensor-granular ZeRO-1/2 for DeepSpeed. ``import ds_tensorshard`` registers it."""

import torch as _torch

from ds_tensorshard.quiet_import import import_deepspeed

_deepspeed = import_deepspeed()

from ds_tensorshard.versions import check_deepspeed_version, check_torch_version  # noqa: E402

check_deepspeed_version(_deepspeed.__version__)
check_torch_version(_torch.__version__)

from ds_tensorshard.build_locks import remove_stopped_and_say  # noqa: E402
from ds_tensorshard.config.schema import TensorShardConfig  # noqa: E402
from ds_tensorshard.datapath.plan import OwnershipPlan, plan_ownership  # noqa: E402
from ds_tensorshard.engine_hooks import install, installed  # noqa: E402
from ds_tensorshard.errors import (  # noqa: E402
    CallRefusedAsStock,
    CheckpointError,
    CollectiveTimeout,
    ElasticStoreError,
    HostWorkError,
    ModelSourceError,
    PeerLost,
    PlanError,
    RefusedAsStock,
    StepMismatch,
    TensorAccessError,
    TensorShardConfigError,
    TensorShardUsageError,
    UnsupportedDeepSpeedVersion,
    UnsupportedTorchVersion,
)
from ds_tensorshard.many import initialize_many, step_many  # noqa: E402
from ds_tensorshard.optimizer import TensorShardOptimizer  # noqa: E402

install()
# a JIT build of one of DeepSpeed's ops that was stopped midway left its lock, on which every later load of that op
# would wait forever: remove such locks before this process loads any
remove_stopped_and_say()

__version__ = "0.1.0"
__all__ = [
    "TensorShardConfig",
    "TensorShardConfigError",
    "CheckpointError",
    "CallRefusedAsStock",
    "RefusedAsStock",
    "CollectiveTimeout",
    "ElasticStoreError",
    "HostWorkError",
    "PeerLost",
    "ModelSourceError",
    "PlanError",
    "StepMismatch",
    "TensorAccessError",
    "TensorShardUsageError",
    "UnsupportedDeepSpeedVersion",
    "UnsupportedTorchVersion",
    "TensorShardOptimizer",
    "OwnershipPlan",
    "plan_ownership",
    "install",
    "installed",
    "initialize_many",
    "step_many",
]
