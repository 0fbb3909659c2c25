"""DeepSpeed's own checkpoint tools on ds_tensorshard save folders.

- ``deepspeed.utils.zero_to_fp32`` (HF's documented ``load_state_dict_from_zero_checkpoint``, Lightning's
  ``convert_zero_checkpoint_to_fp32_state_dict``): each of its public functions reads a tag folder through
  the module's ``_get_fp32_state_dict_from_zero_checkpoint``, looked up when it is called. :func:`install`
  wraps that one function: a folder of ds_tensorshard rank files is read by ds_tensorshard's converter
  (the weights of ``convert-checkpoint --to fp32``), any other folder by DeepSpeed's code, unchanged. The
  public functions stay DeepSpeed's own objects, so a name bound with ``from ... import`` before
  ds_tensorshard was imported reaches the wrapper too.
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

import functools
import os
import stat
from collections.abc import Mapping
from typing import Any

from ds_tensorshard.checkpoints import files
from ds_tensorshard.checkpoints.rank_file import RankFile, parse_rank_file_name
from ds_tensorshard.errors import CheckpointError

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
_MARK = "_ds_tensorshard_original"


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


# -- deepspeed.utils.zero_to_fp32 --------------------------------------------------------------------------
def holds_tensorshard_rank_files(folder: str) -> bool:
    """Whether the tag folder's optimizer files are ds_tensorshard rank files. A file that cannot be read
    counts as not ours, unless ds_tensorshard wrote it (it has a digest side file): then it is refused here,
    naming it."""
    if not os.path.isdir(folder):
        return False
    found = sorted(
        (ranks[1], ranks[0], entry) for entry in os.listdir(folder) if (ranks := parse_rank_file_name(entry))
    )
    if not found:
        return False
    path = os.path.join(folder, found[0][2])
    try:
        files.verify(path)
        payload = files.load(path)
    except CheckpointError:
        if files.recorded_digest(path) is not None:
            raise
        return False  # DeepSpeed's reader gives its own account of the file
    state = payload.get("optimizer_state_dict") if isinstance(payload, Mapping) else None
    return isinstance(state, Mapping) and RankFile.holds(state)


def tensorshard_fp32_state_dict(folder: str, exclude_frozen_parameters: bool = False) -> dict:
    """What ``convert-checkpoint --to fp32`` writes for the tag folder (fp32 trained tensors from the masters,
    frozen tensors and buffers from the module, tied aliases sharing their owner's tensor)."""
    from ds_tensorshard.checkpoints.convert import fp32_state_dict
    from ds_tensorshard.checkpoints.sources import mp_ranks, open_checkpoint

    ranks = mp_ranks(folder)
    if len(ranks) > 1:
        raise CheckpointError(
            f"checkpoint {folder} has {len(ranks)} model-parallel ranks, and zero_to_fp32 gives one state dict: "
            f"`ds-tensorshard convert-checkpoint {folder} weights.pt --to fp32` writes one file per rank"
        )
    return fp32_state_dict(open_checkpoint(folder), exclude_frozen=exclude_frozen_parameters)


def _wrap_fp32_reader(original):
    @functools.wraps(original)
    def _get_fp32_state_dict_from_zero_checkpoint(ds_checkpoint_dir, *args, **kwargs):
        if not holds_tensorshard_rank_files(ds_checkpoint_dir):
            return original(ds_checkpoint_dir, *args, **kwargs)
        exclude = args[0] if args else kwargs.get("exclude_frozen_parameters", False)
        return tensorshard_fp32_state_dict(ds_checkpoint_dir, bool(exclude))

    return _get_fp32_state_dict_from_zero_checkpoint


def install() -> None:
    """Route DeepSpeed's zero_to_fp32 functions to ds_tensorshard's converter for its folders (idempotent)."""
    from deepspeed.utils import zero_to_fp32

    current = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint
    if getattr(current, _MARK, None) is None:
        wrapped = _wrap_fp32_reader(current)
        setattr(wrapped, _MARK, current)
        zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint = wrapped


def installed() -> bool:
    from deepspeed.utils import zero_to_fp32

    return getattr(zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint, _MARK, None) is not None
