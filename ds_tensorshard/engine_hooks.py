"""Registration: small overrides on DeepSpeedEngine that route ZeRO-1/2 to TensorShardOptimizer.

DeepSpeed has no optimizer registry, so ``install()`` wraps (idempotently):
- ``__init__``: validate the config first, before any model move or optimizer state, and wait for every rank
  (``transports.shutdown.all_arrived``, within ``tensorshard.timeout_s``); after it, warn (rank 0) where torchrun
  may restart the workers with the previous round's store because the process group was made before the plugin
  was imported (``config.elastic``; otherwise ``transports.elastic_store`` gives each round its own);
- ``_do_optimizer_sanity_check``: keep the ZeRO route for every dtype (stock sends bf16 + fp32
  accumulation at stage 1 to BF16_Optimizer instead);
- ``_configure_zero_optimizer``: build a TensorShardOptimizer instead of DeepSpeedZeroOptimizer;
- ``compile``: refuse ``compiled_autograd_enabled``, an argument initialize cannot see;
- ``save_checkpoint``, ``load_checkpoint``, ``_load_zero_checkpoint``, ``load_module_state_dict``,
  ``_get_ckpt_name``: see :mod:`.checkpoints.hooks`;
- ``coalesce_grad_reduction`` (DeepSpeed 0.19.2; absent before): stock's, but refused where stock's would meet
  BF16_Optimizer; ``_flush_coalesced_reduction_zero12`` and ``_flush_coalesced_reduction_zero3``, its flush at
  stages 1/2 and 3: ds_tensorshard's (:mod:`.coalesce`).
Engines whose config does not enable the plugin run the stock methods untouched. It also routes
``deepspeed.utils.zero_to_fp32`` to ds_tensorshard's converter for ds_tensorshard folders
(:mod:`.checkpoints.fp32_reader`; stock folders still go to DeepSpeed's code).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from typing import TYPE_CHECKING

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION
from deepspeed.utils import log_dist

from ds_tensorshard.checkpoints import fp32_reader
from ds_tensorshard.checkpoints.hooks import (
    wrap_get_ckpt_name,
    wrap_load_checkpoint,
    wrap_load_module_state_dict,
    wrap_load_zero_checkpoint,
    wrap_save_checkpoint,
)
from ds_tensorshard.coalesce import stock_refusal
from ds_tensorshard.config.elastic import elastic_store_warning
from ds_tensorshard.config.engine_checks import validate_engine_config
from ds_tensorshard.config.parallel_layout import validate_parallel_layout
from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.inner_optimizer import check_supported
from ds_tensorshard.errors import CallRefusedAsStock, PeerLost, TensorShardConfigError
from ds_tensorshard.full_tensors import attach
from ds_tensorshard.parameters import init_hooks
from ds_tensorshard.transports import elastic_store, shutdown

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

_MARK = "_ds_tensorshard_original"
_INIT_SIGNATURE = inspect.signature(DeepSpeedEngine.__init__)


def _enabled_config(engine: DeepSpeedEngine) -> TensorShardConfig | None:
    return getattr(engine, "_tensorshard_config", None)


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = _INIT_SIGNATURE.bind(self, *args, **kwargs)
        config_class = bound.arguments.get("config_class")
        if config_class is not None:
            self._tensorshard_config = validate_engine_config(
                config_class._param_dict, bound.arguments.get("optimizer")
            )
            if self._tensorshard_config is not None:
                validate_parallel_layout(
                    bound.arguments.get("model"), bound.arguments.get("mpu"), config_class._param_dict
                )
                _all_arrived(self._tensorshard_config)
        original(self, *args, **kwargs)
        warning = None
        if _enabled_config(self) is not None and not elastic_store.round_store_in_use():
            warning = elastic_store_warning(os.environ)
        if warning is not None:
            log_dist(warning, [0], level=logging.WARNING)

    return __init__


def _all_arrived(config: TensorShardConfig) -> None:
    """Every rank at ``deepspeed.initialize`` within ``timeout_s`` (a lost peer named, not waited for), and on
    the mpi transport the MPI world the torch.distributed world."""
    import torch.distributed

    if torch.distributed.is_initialized():
        try:
            shutdown.all_arrived(config.timeout_s, "deepspeed.initialize", mpi=False)
        except PeerLost as err:
            if config.comm_backend == "mpi":
                shutdown.fail(str(err), mpi=True)
            raise
    if config.comm_backend == "mpi":
        from ds_tensorshard.transports.mpi_comm import check_mpi_world

        check_mpi_world()


def _wrap_sanity_check(original):
    @functools.wraps(original)
    def _do_optimizer_sanity_check(self, basic_optimizer):
        if _enabled_config(self) is None:
            return original(self, basic_optimizer)
        check_supported(basic_optimizer, self.zero_cpu_offload())
        return ZERO_OPTIMIZATION

    return _do_optimizer_sanity_check


def _wrap_configure_zero(original):
    @functools.wraps(original)
    def _configure_zero_optimizer(self, optimizer):
        config = _enabled_config(self)
        if config is None:
            return original(self, optimizer)
        from ds_tensorshard.many import joint_plan_of
        from ds_tensorshard.optimizer import TensorShardOptimizer

        if self.zero_optimization_partition_weights():
            from ds_tensorshard.parameters.accessors import attach_stage3
            from ds_tensorshard.stage3 import configure_stage3

            sharded = configure_stage3(self, optimizer, config)
            attach(sharded)
            attach_stage3(sharded, self.module)  # stage 3's safe_get_* go through param._z3_optimizer
            return sharded
        sharded = TensorShardOptimizer(optimizer, engine=self, config=config, joint_plan=joint_plan_of(self.module))
        attach(sharded)  # deepspeed.utils.safe_get_full_* / safe_set_full_* on every trained parameter
        return sharded

    return _configure_zero_optimizer


def _wrap_coalesce(original):
    @functools.wraps(original)
    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        refusal = stock_refusal(self) if _enabled_config(self) is not None else None
        if refusal is not None:
            raise CallRefusedAsStock(refusal)
        with original(self):
            yield

    return coalesce_grad_reduction


def _wrap_flush(original):
    """Stock's flush of a ``coalesce_grad_reduction()`` block (ZeRO-1/2's and ZeRO-3's; each drives stock's own
    reducer): ds_tensorshard's, one at every stage."""

    @functools.wraps(original)
    def flush(self, optimizer):
        if _enabled_config(self) is None:
            return original(self, optimizer)
        optimizer.flush_coalesced_reduction()

    return flush


def _wrap_compile(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        if _enabled_config(self) is not None and arguments.get("compiled_autograd_enabled"):
            raise TensorShardConfigError(
                "engine.compile(compiled_autograd_enabled=True) is not supported by ds_tensorshard: compiled "
                "autograd traces the gradient hooks, which start the reductions onto owners (stock ZeRO-2's hooks "
                "fail to trace too); call engine.compile() without it"
            )
        return original(self, *args, **kwargs)

    return compile


_WRAPPERS = {
    "__init__": _wrap_init,
    "_do_optimizer_sanity_check": _wrap_sanity_check,
    "_configure_zero_optimizer": _wrap_configure_zero,
    "compile": _wrap_compile,
    "save_checkpoint": wrap_save_checkpoint,
    "load_checkpoint": wrap_load_checkpoint,
    "_load_zero_checkpoint": wrap_load_zero_checkpoint,
    "load_module_state_dict": wrap_load_module_state_dict,
    "_get_ckpt_name": wrap_get_ckpt_name,
    "coalesce_grad_reduction": _wrap_coalesce,
    "_flush_coalesced_reduction_zero12": _wrap_flush,
    "_flush_coalesced_reduction_zero3": _wrap_flush,
}
# engine methods that older DeepSpeed releases do not have
_OPTIONAL = {
    "coalesce_grad_reduction",
    "_flush_coalesced_reduction_zero12",
    "_flush_coalesced_reduction_zero3",
    "compile",
}


def install() -> None:
    """Register ds_tensorshard with DeepSpeed (safe to call any number of times)."""
    for name, wrap in _WRAPPERS.items():
        current = getattr(DeepSpeedEngine, name, None)
        if current is None and name in _OPTIONAL:
            continue
        if getattr(current, _MARK, None) is None:
            wrapped = wrap(current)
            setattr(wrapped, _MARK, current)
            setattr(DeepSpeedEngine, name, wrapped)
    fp32_reader.install()
    elastic_store.install()
    init_hooks.install()


def installed() -> bool:
    return (
        fp32_reader.installed()
        and elastic_store.installed()
        and init_hooks.installed()
        and all(
            getattr(getattr(DeepSpeedEngine, name), _MARK, None) is not None
            for name in _WRAPPERS
            if name not in _OPTIONAL or hasattr(DeepSpeedEngine, name)
        )
    )
