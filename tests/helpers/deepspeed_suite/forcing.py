"""ZeRO stage 3 in a DeepSpeed-suite run (:func:`install`). ``DS_TENSORSHARD=1`` turns ds_tensorshard on for the
stage-1/2 configs only: a stage-3 engine or ``zero.Init`` takes the plugin from a config that carries the
``tensorshard`` block. In the plugin run every stage-3 config that reaches a ``DeepSpeedConfig`` (what
``deepspeed.initialize`` builds) or a ``deepspeed.zero.Init`` gets that block; in both runs each ``zero.Init`` made
with a stage-3 config is recorded (``init3``), and in the plugin run each one whose parameters ds_tensorshard
converts (``owned3``).

This module does not import ds_tensorshard: the stock run must not register the plugin.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Mapping
from typing import Any

import hjson

from tests.helpers.deepspeed_suite.events import record

BLOCK = "tensorshard"  # ds_tensorshard.config.schema.BLOCK
ENV_CONFIG = "DS_TENSORSHARD_CONFIG"  # ds_tensorshard.config.schema.ENV_CONFIG: the forced block's keys
_MARK = "_suite_forced"


def as_dict(config: Any) -> dict[str, Any] | None:
    """A config as a dict: given as a mapping, or a JSON/HJSON file's path; ``None`` for anything else (no config,
    a base64 string, a ``DeepSpeedConfig``)."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            loaded = hjson.load(f)
        return dict(loaded) if isinstance(loaded, Mapping) else None
    return None


def is_stage3(param_dict: Mapping[str, Any] | None) -> bool:
    zero = (param_dict or {}).get("zero_optimization")
    return isinstance(zero, Mapping) and zero.get("stage") == 3


def with_block(config: Any) -> Any:
    """``config`` as a dict with the ``tensorshard`` block (enabled, with the keys of ``DS_TENSORSHARD_CONFIG``)
    where it asks for ZeRO stage 3 and has no block of its own; any other config unchanged."""
    param_dict = as_dict(config)
    if param_dict is None or BLOCK in param_dict or not is_stage3(param_dict):
        return config
    return {**param_dict, BLOCK: {"enabled": True, **json.loads(os.environ.get(ENV_CONFIG) or "{}")}}


def _wrap_config(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, with_block(config), *args, **kwargs)

    return __init__


def _wrap_zero_init(original, force: bool):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        config = bound.arguments.get("config_dict_or_path") or bound.arguments.get("config")
        stage3 = bound.arguments.get("enabled", True) and is_stage3(as_dict(config))
        if force:
            for key in ("config_dict_or_path", "config"):
                if key in bound.arguments:
                    bound.arguments[key] = with_block(bound.arguments[key])
        original(*bound.args, **bound.kwargs)
        if stage3:
            record("init3")
        if force and self.__dict__.get("_ts_owned") is not None:  # ds_tensorshard's init_hooks converts them
            record("owned3")

    return __init__


def install(force: bool) -> None:
    """Record the stage-3 ``zero.Init`` calls; with ``force`` (the plugin run, after ds_tensorshard has registered
    its own wrappers, so that these see the config first) add the block to every stage-3 config."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.partition_parameters import Init

    if getattr(Init.__init__, _MARK, False):
        return
    Init.__init__ = _wrap_zero_init(Init.__init__, force)  # type: ignore[method-assign]
    setattr(Init.__init__, _MARK, True)
    if force:
        DeepSpeedConfig.__init__ = _wrap_config(DeepSpeedConfig.__init__)  # type: ignore[method-assign]
