"""DeepSpeed's own checkpoint tools on ds_tensorshard save folders (``deepspeed.utils.zero_to_fp32`` itself:
:mod:`.fp32_reader`).

- ``zero_to_fp32.py`` in a save dir: ds_tensorshard's saves and ``--to tensorshard`` conversions hold
  :mod:`.zero_to_fp32_script` under that name (DeepSpeed's command line, run with ds_tensorshard
  imported); ``--to zero`` conversions hold DeepSpeed's own copy, as a stock save does.
- ``ds_to_universal``: the model-states file of a ds_tensorshard checkpoint declares, in
  ``universal_checkpoint_info``, that no parameter can be converted and why (:func:`refuse_universal_conversion`).
  DeepSpeed 0.19.8 checks that entry first and stops with the reason, which names ``convert-checkpoint``;
  releases whose ds_to_universal lacks the check (0.19.0 and earlier, by their sources) fail later, on
  the ZeRO entries the rank files do not have (``KeyError: 'param_slice_mappings'``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

from ds_tensorshard.checkpoints import files

UNIVERSAL_INFO = "universal_checkpoint_info"
UNCONVERTIBLE = "autotp_unsupported_parameter_patterns"  # ds_to_universal: {pattern: reason}, refused if any
EVERY_PARAMETER = ".*"
UNIVERSAL_REFUSAL = (
    "this is a ds_tensorshard checkpoint, whose rank files hold whole tensors by name rather than ZeRO's flat "
    "partitions; ds_tensorshard loads it at any world size as it is, and "
    "`ds-tensorshard convert-checkpoint SAVE_DIR OUT_DIR --to zero --world-size N` writes the stock ZeRO "
    "checkpoint that ds_to_universal converts"
)
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_to_fp32_script.py")


# -- ds_to_universal ----------------------------------------------------------------------------------
def refuse_universal_conversion(model_states: Mapping[str, Any]) -> dict:
    """``model_states`` (a model-states file's dict, not changed) with the entry that makes ds_to_universal
    refuse it, kept beside any ``universal_checkpoint_info`` the states already have."""
    info = dict(model_states.get(UNIVERSAL_INFO) or {})
    info[UNCONVERTIBLE] = {**(info.get(UNCONVERTIBLE) or {}), EVERY_PARAMETER: UNIVERSAL_REFUSAL}
    return {**model_states, UNIVERSAL_INFO: info}


def _ours(reason: Any) -> bool:
    return isinstance(reason, str) and reason.startswith("this is a ds_tensorshard checkpoint")


def without_universal_refusal(model_states: Mapping[str, Any]) -> dict:
    """``model_states`` as they were before :func:`refuse_universal_conversion` (a copy)."""
    states = dict(model_states)
    info = states.get(UNIVERSAL_INFO)
    if not isinstance(info, Mapping) or not _ours((info.get(UNCONVERTIBLE) or {}).get(EVERY_PARAMETER)):
        return states
    info = dict(info)
    unconvertible = {k: v for k, v in info.pop(UNCONVERTIBLE).items() if k != EVERY_PARAMETER}
    if unconvertible:
        info[UNCONVERTIBLE] = unconvertible
    if info:
        states[UNIVERSAL_INFO] = info
    else:
        del states[UNIVERSAL_INFO]
    return states


# -- zero_to_fp32.py in a save dir -----------------------------------------------------------------------
def _install_script(source: str, target: str) -> None:
    with open(source) as f:
        text = f.read()
    files.write_text_atomic(target, text)
    os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def write_recovery_script(save_dir: str) -> None:
    """ds_tensorshard's ``zero_to_fp32.py`` into a save dir (replacing DeepSpeed's copy)."""
    _install_script(SCRIPT, os.path.join(save_dir, "zero_to_fp32.py"))


def copy_deepspeed_recovery_scripts(save_dir: str) -> None:
    """DeepSpeed's own ``zero_to_fp32.py`` (and ``zero_to_torch.py`` where the release has it) into a save dir
    of stock checkpoints, as DeepSpeed's save does."""
    from deepspeed.utils import zero_to_fp32

    utils = os.path.dirname(os.path.abspath(zero_to_fp32.__file__))
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        if os.path.isfile(os.path.join(utils, script)):
            _install_script(os.path.join(utils, script), os.path.join(save_dir, script))
