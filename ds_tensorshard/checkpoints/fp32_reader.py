"""``deepspeed.utils.zero_to_fp32`` on ds_tensorshard save folders (HF's documented
``load_state_dict_from_zero_checkpoint``, Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``).

Each of its public functions reads a tag folder through the module's ``_get_fp32_state_dict_from_zero_checkpoint``,
looked up when it is called. :func:`install` wraps that one function: a folder of ds_tensorshard rank files is
read by ds_tensorshard's converter (the weights of ``convert-checkpoint --to fp32``), any other folder by
DeepSpeed's code, unchanged. The public functions stay DeepSpeed's own objects, so a name bound with
``from ... import`` before ds_tensorshard was imported reaches the wrapper too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from ds_tensorshard.checkpoints import files
from ds_tensorshard.checkpoints.consolidate import lazy_state_dict
from ds_tensorshard.checkpoints.rank_file import RankFile, parse_rank_file_name
from ds_tensorshard.checkpoints.sources import mp_ranks, open_checkpoint
from ds_tensorshard.errors import CheckpointError

_MARK = "_ds_tensorshard_original"


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
    """What ``convert-checkpoint --to fp32`` writes for the tag folder, unread: a :class:`.consolidate.LazyTensor`
    per entry (fp32 trained tensors from the masters, frozen tensors and buffers from the module, a tied alias its
    owner's object), as DeepSpeed's reader hands ZeRO-3 tensors to its callers (``GatheredTensor``): its
    ``to_torch_tensor`` reads them, and ``convert_zero_checkpoint_to_state_dict`` one shard at a time."""
    ranks = mp_ranks(folder)
    if len(ranks) > 1:
        raise CheckpointError(
            f"checkpoint {folder} has {len(ranks)} model-parallel ranks, and zero_to_fp32 gives one state dict: "
            f"`ds-tensorshard convert-checkpoint {folder} weights.pt --to fp32` writes one file per rank"
        )
    return lazy_state_dict(open_checkpoint(folder), exclude_frozen=exclude_frozen_parameters)


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
