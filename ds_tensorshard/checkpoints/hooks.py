"""Engine checkpoint methods for ds_tensorshard engines: atomic saves, loads at any world size.

``save_checkpoint``: every file is written atomically with its digest into a staging folder, every
file of one save carries one checkpoint id; only when every rank's files are complete does the
staging folder become the tag's folder (replacing an earlier save of the same tag whole) and
``latest`` move. A write that fails on any rank fails the save on every rank, naming the file, and
leaves nothing of it behind; so does a save in which rank 0 does not find every file another rank
wrote, at its size (a save folder not shared between hosts), naming those ranks and the folder. The
staging folder of a save whose rank was killed stays until the next complete save of that tag
removes it (it is never taken for a checkpoint); the surviving ranks' save fails with an error that quotes
the transport's (which names the lost peer's address) where a collective of the save failed.
``load_checkpoint``: the checkpoint (ds_tensorshard, stock ZeRO-1/2 or universal) is opened and
checked against the model *before* DeepSpeed touches any state; then DeepSpeed loads the module,
scheduler and client state as usual and ``_load_zero_checkpoint`` hands each rank its owned
tensors, whatever world size saved them.

At ZeRO stage 3 (``_get_ckpt_name``) the folder keeps the layout of stages 1/2: one module file, rank 0's, whose
parameters are DeepSpeed's empty placeholders, each parameter's value in its owner's rank file
(:mod:`.kept`). ``load_module_state_dict`` is then ds_tensorshard's where the module's values are found by name
(:mod:`.saved_module`): at stage 3 each owner copies its blocks into its ``ds_tensor`` (:func:`.kept.load_owned`),
and a stage-1/2 engine loading a stage-3 save gets the module whole.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deepspeed.runtime.engine as deepspeed_engine
import torch.distributed
from deepspeed import comm as dist
from deepspeed.checkpoint.constants import FROZEN_PARAM_FRAGMENTS
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ds_tensorshard.checkpoints.files import (
    digest_path,
    digested_name,
    fsync_dir,
    load_for_deepspeed,
    read_latest,
    save_atomic,
    write_text_atomic,
)
from ds_tensorshard.checkpoints.kept import load_owned
from ds_tensorshard.checkpoints.rank_file import parse_rank_file_name
from ds_tensorshard.checkpoints.saved_module import SavedModule, expected_module, placeholder_names
from ds_tensorshard.checkpoints.sources import CHECKPOINT_ID_KEY, CheckpointSource, open_checkpoint, read_model_states
from ds_tensorshard.checkpoints.stock_tools import (
    refuse_universal_conversion,
    without_universal_refusal,
    write_recovery_script,
)
from ds_tensorshard.errors import CheckpointError, TensorShardConfigError

_MODEL_STATES = re.compile(r"mp_rank_\d+_model_states\.pt")
# the checkpoint an engine's load_checkpoint opened, for the _load_zero_checkpoint it calls to read
_OPENED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# its module values, where ds_tensorshard loads the module (stage 3, or a stage-3 save at stages 1/2), and whether
# the optimizer's load (its masters) follows
_SAVED_MODULE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MASTERS_FOLLOW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _enabled(engine) -> bool:
    return getattr(engine, "_tensorshard_config", None) is not None


def _mp_rank(engine) -> int:
    """The model-parallel rank in checkpoint file names (``engine.checkpoint_mp_rank`` from 0.19.7 on)."""
    return 0 if engine.mpu is None else engine.mpu.get_model_parallel_rank()


def _shared_checkpoint_id() -> str:
    box = [uuid.uuid4().hex]
    torch.distributed.broadcast_object_list(box, src=0)  # deepspeed.comm has no object collectives before 0.17
    return box[0]


def _remove_stale_rank_files(folder: str, world_size: int) -> None:
    """Drop optimizer files of ranks >= world_size left by an earlier, larger save of the same tag."""
    for entry in os.listdir(folder):
        ranks = parse_rank_file_name(digested_name(entry) or entry)
        if ranks is not None and ranks[0] >= world_size:
            os.remove(os.path.join(folder, entry))


def wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        client_state = {} if client_state is None else client_state
        if not _enabled(self):
            return original(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if type(self.checkpoint_engine) is not TorchCheckpointEngine:
            raise TensorShardConfigError(
                f"checkpoint engine {type(self.checkpoint_engine).__name__} is not supported "
                "by ds_tensorshard; use DeepSpeed's default (torch) checkpoint engine"
            )
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        self.optimizer.checkpoint_id = _shared_checkpoint_id()
        stage3 = self.zero_optimization_partition_weights()
        if stage3:  # one module file, rank 0's (named by _get_ckpt_name), as at stages 1/2
            self.save_non_zero_checkpoint = self.optimizer.comm.rank == 0
            self.optimizer.save_frozen = not exclude_frozen_parameters
        final = os.path.join(save_dir, tag)
        staging = os.path.join(save_dir, f".{tag}.saving-{self.optimizer.checkpoint_id[:12]}")
        failures: list[str] = []
        written: dict[str, int] = {}  # each file this rank wrote, relative to save_dir: its size
        self.checkpoint_engine.save = _staging_writer(save_dir, final, staging, failures, written, stage3)  # this save
        try:
            original(
                self,
                save_dir,
                tag,
                {**client_state, CHECKPOINT_ID_KEY: self.optimizer.checkpoint_id},
                False,
                exclude_frozen_parameters,
            )
        except RuntimeError as err:  # the writes do not raise (below): a barrier of DeepSpeed's save failed
            raise _lost_rank(final, staging, err) from err
        finally:
            del self.checkpoint_engine.save
        _commit_save(self, save_dir, tag, staging, failures, written, save_latest)
        return True

    return save_checkpoint


def _staging_writer(
    save_dir: str, final: str, staging: str, failures: list[str], written: dict[str, int], stage3: bool
) -> Callable[[Any, str], None]:
    """The checkpoint engine's ``save`` for one save: every file goes to a staging folder (beside the tag's, never
    named like a tag); a failed write is recorded in ``failures``, not raised, so that no rank is left in
    DeepSpeed's barriers; each file written (and its digest) is recorded in ``written`` with its size. At
    ``stage3`` the module file drops DeepSpeed's ``frozen_param_fragments`` (rank 0's blocks of the untrained
    parameters: their owners' rank files hold them whole)."""

    def save(state_dict, path: str) -> None:
        target = os.path.join(staging, os.path.relpath(path, final)) if _inside(path, final) else path
        if _MODEL_STATES.fullmatch(os.path.basename(path)):
            if stage3:
                state_dict = {**state_dict, FROZEN_PARAM_FRAGMENTS: None}
            state_dict = refuse_universal_conversion(state_dict)  # ds_to_universal: say why not
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            save_atomic(state_dict, target)
            for done in (target, digest_path(target)):
                written[os.path.relpath(done, save_dir)] = os.path.getsize(done)
        except Exception as err:  # noqa: BLE001 - disk full, file too large, read-only: all end the save
            failures.append(f"{path}: {type(err).__name__}: {err}")

    return save


def _commit_save(
    engine, save_dir: str, tag: str, staging: str, failures: list[str], written: dict[str, int], save_latest: bool
) -> None:
    """After DeepSpeed's save: every rank reports its failures and files; rank 0 moves the staging folder into
    place (and ``latest``) only if every file is complete, else discards it; every rank raises the same error."""
    final = os.path.join(save_dir, tag)
    if engine.global_rank == 0:  # where DeepSpeed's save just copied its own zero_to_fp32.py
        try:
            write_recovery_script(save_dir)
        except Exception as err:  # noqa: BLE001 - as for the checkpoint files
            failures.append(f"{os.path.join(save_dir, 'zero_to_fp32.py')}: {type(err).__name__}: {err}")
    reports: list = [None] * dist.get_world_size()
    try:
        torch.distributed.all_gather_object(reports, (failures, written))  # every file complete, on every rank?
    except RuntimeError as err:
        raise _lost_rank(final, staging, err) from err
    verdict: list[str | None] = [None]
    if engine.global_rank == 0:
        verdict[0] = _save_failure(save_dir, final, staging, reports)
        if verdict[0] is not None:
            _discard(staging, final)
        else:
            _move_into_place(staging, final)
            _remove_stale_rank_files(final, engine.optimizer.comm.world_size)
            _remove_abandoned_staging(save_dir, tag)
            if save_latest:
                write_text_atomic(os.path.join(save_dir, "latest"), tag)
    torch.distributed.broadcast_object_list(verdict, src=0)  # after rank 0 committed (or discarded) the save
    if verdict[0] is not None:
        _discard(staging, final)  # this rank's own copy, where its host does not share rank 0's folder
        raise CheckpointError(verdict[0])


def _lost_rank(final: str, staging: str, err: RuntimeError) -> CheckpointError:
    """A collective of the save failed before every rank reported (a rank or host lost mid-save): rank 0 cannot
    commit without every report, so the staging folder stays, never taken for a checkpoint (as a killed rank's)."""
    return CheckpointError(
        f"saving checkpoint {final} failed: a rank was lost before every rank reported its files "
        f"({type(err).__name__}: {' '.join(str(err).split())[:400]}); it stays in {staging}, never loaded, "
        "and 'latest' was not moved"
    )


def _save_failure(save_dir: str, final: str, staging: str, reports: list) -> str | None:
    """Why the save cannot be committed, from every rank's (failed writes, files written with their sizes), or
    None: a failed write first, then files rank 0 does not find in its ``save_dir`` at the size written."""
    kept = "; nothing of it was kept and 'latest' was not moved"
    failed = [(rank, failure) for rank, (found, _) in enumerate(reports) for failure in found]
    if failed:
        rank, failure = failed[0]
        more = f" and {len(failed) - 1} more file(s)" if len(failed) > 1 else ""
        return f"saving checkpoint {final} failed on rank {rank} ({failure}){more}{kept}"
    unseen = {
        rank: [name for name, size in written.items() if not _has_size(os.path.join(save_dir, name), size)]
        for rank, (_, written) in enumerate(reports)
    }
    ranks = [rank for rank, names in unseen.items() if names]
    if not ranks:
        return None
    return (
        f"saving checkpoint {final} failed: rank 0 does not find the files of rank(s) {', '.join(map(str, ranks))} "
        f"in {staging} (first: {unseen[ranks[0]][0]}, written by rank {ranks[0]}); the save folder {save_dir} must "
        f"be one folder that every rank writes to, shared between the hosts at the same path{kept}"
    )


def _has_size(path: str, size: int) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == size


def _discard(staging: str, final: str) -> None:
    """Remove a failed save's staging folder and its empty tag folder (another rank may be removing them too)."""
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _remove_if_empty(final)
    except FileNotFoundError:
        pass


def _inside(path: str, folder: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep)


def _remove_if_empty(folder: str) -> None:
    if os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)


def _remove_abandoned_staging(save_dir: str, tag: str) -> None:
    """Staging folders of earlier saves of ``tag`` that never completed (a rank killed mid-write): the save
    that just completed replaces them."""
    for entry in os.listdir(save_dir):
        if entry.startswith(f".{tag}.saving-"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)


def _move_into_place(staging: str, final: str) -> None:
    """The complete save becomes the tag's folder; an earlier save of the same tag is replaced whole."""
    if os.path.isdir(final) and os.listdir(final):
        replaced = f"{staging}.replaced"
        os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced)
    else:
        _remove_if_empty(final)
        os.replace(staging, final)
    fsync_dir(final)


def _resolve_tag(load_dir: str, tag, universal: bool):
    return str(tag) if tag is not None else read_latest(load_dir, universal)  # None: DeepSpeed reports it


@dataclass(frozen=True)
class _Load:
    """What ``load_checkpoint`` was asked for, as far as opening the checkpoint goes."""

    strict: bool
    optimizer_states: bool
    module_only: bool
    custom_load_fn: object


def _open_for_load(
    engine, folder: str, universal: bool, load: _Load
) -> tuple[CheckpointSource | None, SavedModule | None]:
    """The checkpoint opened and checked against the model before DeepSpeed touches any state: its rank files
    where the optimizer state is loaded or the module's values are in them (a stage-3 save), and, where
    ds_tensorshard loads the module (stage 3, or a stage-3 save), its values by name, checked too."""
    stage3 = engine.zero_optimization_partition_weights()
    if stage3 and load.custom_load_fn is not None:
        raise CheckpointError(
            "load_checkpoint(custom_load_fn=...) at ZeRO stage 3 with ds_tensorshard is not supported: the "
            "parameters are kept by their owners, not in the module; load without it"
        )
    states = read_model_states(folder, _mp_rank(engine))
    placeholders = not universal and bool(placeholder_names(states))
    optimizer_states = load.optimizer_states and not load.module_only
    if not (optimizer_states or universal or stage3 or placeholders):
        return None, None  # stock reads no optimizer file then: the masters are refreshed from the loaded module
    source = open_checkpoint(folder, universal=universal, mp_rank=_mp_rank(engine), model_states=states)
    if optimizer_states or universal:
        engine.optimizer.check_checkpoint(source)
    if universal or not (stage3 or placeholders):
        return source, None  # DeepSpeed loads the module (a universal checkpoint: none)
    saved = SavedModule(source)
    saved.check(expected_module(engine.module), load.strict)
    return source, saved


@contextlib.contextmanager
def _module_file_for_stage3(saved: SavedModule | None):
    """Stock's stage-3 load without optimizer states replaces the module file's state dict with zero_to_fp32 of
    the ``latest`` tag (whichever tag was asked for); ds_tensorshard's stage-3 module load reads the opened
    tag's values by name instead, so that call is given the opened module file (nothing read twice)."""
    if saved is None:
        yield
        return
    original = deepspeed_engine.get_fp32_state_dict_from_zero_checkpoint
    deepspeed_engine.get_fp32_state_dict_from_zero_checkpoint = lambda *args, **kwargs: dict(saved.entries)
    try:
        yield
    finally:
        deepspeed_engine.get_fp32_state_dict_from_zero_checkpoint = original


def wrap_load_checkpoint(original):
    @functools.wraps(original)
    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        call = functools.partial(
            original,
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )
        if not _enabled(self):
            return call()
        universal = self.load_universal_checkpoint()
        if universal and getattr(self, "has_moe_layers", False):
            raise CheckpointError(
                "ds_tensorshard: loading a universal checkpoint into a mixture-of-experts engine (DeepSpeed MoE "
                "layers) is not supported; load the ZeRO or ds_tensorshard checkpoint itself"
            )
        resolved = _resolve_tag(load_dir, tag, universal)
        if resolved is None:
            return call()
        load = _Load(load_module_strict, load_optimizer_states, load_module_only, custom_load_fn)
        _OPENED[self], _SAVED_MODULE[self] = _open_for_load(self, os.path.join(load_dir, resolved), universal, load)
        _MASTERS_FOLLOW[self] = load_optimizer_states and not load_module_only
        self.checkpoint_engine.load = load_for_deepspeed  # DeepSpeed's own reads: no code from the files either
        try:
            with _module_file_for_stage3(_SAVED_MODULE[self] if self.zero_optimization_partition_weights() else None):
                load_path, client_state = original(
                    self,
                    load_dir,
                    resolved,
                    load_module_strict,
                    load_optimizer_states,
                    load_lr_scheduler_states,
                    load_module_only,
                    custom_load_fn,
                )
        finally:
            del _OPENED[self], _SAVED_MODULE[self], _MASTERS_FOLLOW[self]
            del self.checkpoint_engine.load
        if client_state:
            client_state = without_universal_refusal(client_state)
            client_state.pop(CHECKPOINT_ID_KEY, None)
        return load_path, client_state

    return load_checkpoint


def wrap_load_module_state_dict(original):
    @functools.wraps(original)
    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, **kwargs):
        saved = _SAVED_MODULE.get(self) if _enabled(self) else None
        if saved is None:
            return original(self, checkpoint, strict, custom_load_fn, **kwargs)
        if self.zero_optimization_partition_weights():
            trained = self.optimizer.params if _MASTERS_FOLLOW.get(self) else ()
            return load_owned(self.module, checkpoint, saved, strict, trained)
        # a stage-3 save into a stage-1/2 engine: the module whole, as a stage-1/2 save holds it
        whole = {**checkpoint, "module": saved.completed(), FROZEN_PARAM_FRAGMENTS: None}
        return original(self, whole, strict, custom_load_fn, **kwargs)

    return load_module_state_dict


def wrap_get_ckpt_name(original):
    @functools.wraps(original)
    def _get_ckpt_name(self, checkpoints_path, tag, mp_placeholder=None, pp_placeholder=None):
        """At stage 3 the module file keeps the name of stages 1/2 (one file, rank 0's), so that a folder does not
        depend on the world size that saved it (stock's stage 3 writes one per rank)."""
        if not (_enabled(self) and self.zero_optimization_partition_weights()):
            return original(self, checkpoints_path, tag, mp_placeholder, pp_placeholder)
        mp = mp_placeholder if mp_placeholder is not None else f"{_mp_rank(self):02d}"
        return os.path.join(checkpoints_path, str(tag), f"mp_rank_{mp}_model_states.pt")

    return _get_ckpt_name


def wrap_load_zero_checkpoint(original):
    @functools.wraps(original)
    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        if not _enabled(self):
            return original(self, load_dir, tag, load_optimizer_states)
        source = _OPENED.get(self)
        if source is None:
            source = open_checkpoint(
                os.path.join(load_dir, tag), universal=self.load_universal_checkpoint(), mp_rank=_mp_rank(self)
            )
            self.optimizer.check_checkpoint(source)
        self.optimizer.load_from_source(source, load_optimizer_states)
        return True

    return _load_zero_checkpoint
