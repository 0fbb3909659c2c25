"""Registration on DeepSpeed's ``zero.Init``: an Init that converts parameters for ds_tensorshard gives them the
whole-tensor protocol (:class:`~ds_tensorshard.parameters.owned.OwnedParameters`) instead of stock's slices.

``install()`` wraps (idempotently) four methods of ``deepspeed.zero.Init``; an Init without ownership runs stock's
untouched. An Init owns its parameters when it is made inside :func:`owning` (the stage-3 engine converting its
model: DeepSpeed's ``DeepSpeedZeRoOffload`` makes an ``Init(module=...)``), its
:class:`~ds_tensorshard.parameters.owned.OwnedParameters` then deciding:

- ``_convert_to_deepspeed_param``: stock's attributes, then the owners and the whole-tensor bound methods;
- ``_partition_param``: the owner keeps its tensor, every rank releases the gathered one;
- ``_all_gather``: ``param.all_gather()`` and ``GatheredParameters`` gather from the owners.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from deepspeed.runtime.zero.partition_parameters import Init

from ds_tensorshard.parameters.owned import OwnedParameters

_MARK = "_ds_tensorshard_original"
_OWNING: list[OwnedParameters] = []  # the innermost owning() context's protocol


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
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        self._ts_owned = _OWNING[-1] if _OWNING else None  # before stock's, which converts ``module``
        original(self, *args, **kwargs)

    return __init__


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
