"""Registration on DeepSpeed's ``zero.Init``: an Init that converts parameters for ds_tensorshard gives them the
whole-tensor protocol (:class:`~ds_tensorshard.parameters.owned.OwnedParameters`) instead of stock's slices.

``install()`` wraps (idempotently) four methods of ``deepspeed.zero.Init``; an Init without ownership runs stock's
untouched. An Init owns its parameters when it is made inside :func:`owning` (the stage-3 engine converting its
model: DeepSpeed's ``DeepSpeedZeRoOffload`` makes an ``Init(module=...)``), or when its config enables ds_tensorshard
at stage 3 (a model built under ``deepspeed.zero.Init(config_dict_or_path=...)``, as HF's ``from_pretrained`` does:
:func:`constructing`); its :class:`~ds_tensorshard.parameters.owned.OwnedParameters` then decides:

- ``_convert_to_deepspeed_param``: stock's attributes, then the owners and the whole-tensor bound methods;
- ``_partition_param``: the owner keeps its tensor, every rank releases the gathered one;
- ``_all_gather``: ``param.all_gather()`` and ``GatheredParameters`` gather from the owners.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator, Mapping
from typing import Any

import hjson
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import Init

from ds_tensorshard.config.schema import BLOCK, from_environment, parse_block
from ds_tensorshard.config.stage3_checks import validate_stage3
from ds_tensorshard.parameters.owned import OwnedParameters
from ds_tensorshard.parameters.ownership import ConstructionOwners
from ds_tensorshard.transports import open_transport

_MARK = "_ds_tensorshard_original"
_OWNING: list[OwnedParameters] = []  # the innermost owning() context's protocol
# users' zero.Init protocols, by transport, group, host-kept and pinned
_CONSTRUCTING: dict[tuple[str, bool, int, bool, bool], OwnedParameters] = {}


@contextlib.contextmanager
def owning(owned: OwnedParameters) -> Iterator[None]:
    """Every ``zero.Init`` made inside converts its parameters with ``owned``."""
    _OWNING.append(owned)
    try:
        yield
    finally:
        _OWNING.pop()


def owned_by(init: Init) -> OwnedParameters | None:
    return init.__dict__.get("_ts_owned")


def _wrap_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        # before stock's, which converts ``module``
        self._ts_owned = _OWNING[-1] if _OWNING else constructing(signature.bind(self, *args, **kwargs).arguments)
        original(self, *args, **kwargs)

    return __init__


def constructing(arguments: dict[str, Any]) -> OwnedParameters | None:
    """The protocol of a ``zero.Init`` made by a user (HF's ``from_pretrained``, Accelerate, Lightning) whose config
    enables ds_tensorshard at stage 3: one per process group and transport, so that the loads of every model built
    under it are balanced together (:class:`~ds_tensorshard.parameters.ownership.ConstructionOwners`). A stage-3
    key that ``deepspeed.initialize`` refuses with ds_tensorshard is refused here too, before any parameter is
    built."""
    param_dict = _config_of(arguments.get("config_dict_or_path") or arguments.get("config"))
    if not arguments.get("enabled", True) or param_dict is None:
        return None
    if (param_dict.get("zero_optimization") or {}).get("stage") != 3 or from_environment(param_dict):
        return None
    config = parse_block(param_dict)
    if not config.enabled:
        return None
    validate_stage3(param_dict, param_dict.get(BLOCK) or {})
    if not dist.is_initialized():
        dist.init_distributed()
    group = arguments.get("data_parallel_group") or arguments.get("sequence_data_parallel_group")
    offload = (param_dict.get("zero_optimization") or {}).get("offload_param") or {}
    remote = str(arguments.get("remote_device") or offload.get("device") or "none")  # as stock's Init reads it
    pinned = bool(arguments.get("pin_memory") or offload.get("pin_memory"))
    key = (config.comm_backend, config.shared_memory, id(group), remote == "cpu", pinned)
    if key not in _CONSTRUCTING:
        device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
        comm = open_transport(config, group, device)
        home = torch.device("cpu") if remote == "cpu" else device
        _CONSTRUCTING[key] = OwnedParameters(comm, home, ConstructionOwners(comm.world_size), pinned)
    return _CONSTRUCTING[key]


def _config_of(config: Any) -> dict[str, Any] | None:
    """A ``zero.Init`` config as a dict: given as one, or a JSON/HJSON file's path (as DeepSpeed reads it)."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return hjson.load(f)
    return None


def _wrap_convert(original):
    @functools.wraps(original)
    def _convert_to_deepspeed_param(self, param):
        original(self, param)
        owned = owned_by(self)
        if owned is not None:
            owned.adopt(param)

    return _convert_to_deepspeed_param


def _wrap_partition_param(original):
    @functools.wraps(original)
    def _partition_param(self, param, buffer=None, has_been_updated=False, free_data=True):
        owned = owned_by(self)
        if owned is None:
            return original(self, param, buffer, has_been_updated, free_data)
        owned.keep(param, has_been_updated, free_data)

    return _partition_param


def _wrap_all_gather(original):
    @functools.wraps(original)
    def _all_gather(self, param_list, async_op=False, hierarchy=None):
        owned = owned_by(self)
        if owned is None:
            return original(self, param_list, async_op, hierarchy)
        handle = owned.start(list(param_list))
        if async_op:
            return [handle]
        handle.wait()
        return None

    return _all_gather


_WRAPPERS = {
    "__init__": _wrap_init,
    "_convert_to_deepspeed_param": _wrap_convert,
    "_partition_param": _wrap_partition_param,
    "_all_gather": _wrap_all_gather,
}


def install() -> None:
    """Wrap ``zero.Init`` (safe to call any number of times)."""
    for name, wrap in _WRAPPERS.items():
        current = getattr(Init, name)
        if getattr(current, _MARK, None) is None:
            wrapped = wrap(current)
            setattr(wrapped, _MARK, current)
            setattr(Init, name, wrapped)


def installed() -> bool:
    return all(getattr(getattr(Init, name), _MARK, None) is not None for name in _WRAPPERS)
