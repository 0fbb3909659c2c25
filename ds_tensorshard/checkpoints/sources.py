"""Readers for the checkpoints ds_tensorshard loads: its own, stock ZeRO-1/2, DeepSpeed universal.

Each reader checks its files when opened (present, intact, a known format and version, one save)
and then hands out one tensor's optimizer state at a time, re-reading memory-mapped files so that
no more than one tensor's state is held beyond what the caller keeps.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_tensorshard.checkpoints import files
from ds_tensorshard.checkpoints.experts import expert_name
from ds_tensorshard.checkpoints.rank_file import (
    RankFile,
    loss_scaler_fields,
    parse_rank_file_name,
    rank_file_name,
    step_int,
)
from ds_tensorshard.errors import CheckpointError

CHECKPOINT_ID_KEY = "ds_tensorshard_checkpoint_id"
MODEL_STATES = "mp_rank_00_model_states.pt"  # model-parallel rank 0's, present in every checkpoint
STOCK_ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # stock ZeRO-3's rank 0 (one per rank)


def model_states_name(mp_rank: int) -> str:
    """DeepSpeed's name for a model-parallel rank's module file."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def mp_ranks(folder: str) -> list[int]:
    """The model-parallel ranks a checkpoint folder holds module files of."""
    found = (re.match(r"^mp_rank_(\d+)_model_states\.pt$", entry) for entry in os.listdir(folder))
    return sorted(int(match.group(1)) for match in found if match)


@dataclass
class TensorState:
    """One tensor's optimizer state as stored: its fp32 master and the inner optimizer's state
    (e.g. ``step``, ``exp_avg``, ``exp_avg_sq``; empty before the first step)."""

    master: torch.Tensor
    state: dict[str, Any]


@dataclass
class ScalerState:
    loss_scaler: dict[str, Any] | None  # plain fields (see rank_file.loss_scaler_fields)
    dynamic_loss_scale: bool
    overflow: bool
    clip_grad: float


def scaler_state(state: Mapping[str, Any]) -> ScalerState:
    """Loss-scaler facts of a stock ZeRO or universal optimizer file."""
    scaler = state.get("loss_scaler")
    return ScalerState(
        loss_scaler_fields(scaler) if scaler is not None else None,
        bool(state.get("dynamic_loss_scale")),
        bool(state.get("overflow")),
        float(state.get("clip_grad", 0.0)),
    )


class CheckpointSource:
    """What every reader offers."""

    kind: str
    folder: str
    world_size: int
    group_names: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    param_groups: list[dict]  # hyper-parameters per group; empty when the checkpoint has none
    scaler: ScalerState | None
    model_states: dict  # the checkpoint's mp_rank_XX_model_states.pt of its model-parallel rank (memory-mapped)

    def tensor(self, name: str) -> TensorState:
        raise NotImplementedError

    def master(self, name: str) -> torch.Tensor:
        """The tensor's fp32 master alone (what a consolidation reads; readers override it to skip the state)."""
        return self.tensor(name).master

    def kept_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of a stage-3 save's untrained parameter ``name``, which its rank files hold (None where they
        do not: at stages 1/2 and in stock checkpoints the module file holds every untrained parameter)."""
        return None

    def kept_parameter(self, name: str) -> torch.Tensor | None:
        """That parameter's value, whole (None where the rank files do not hold it)."""
        return None

    def check_model(self, group_names: Sequence[Sequence[str]], shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse a checkpoint of another model: missing, extra or reshaped tensors, other param groups."""
        missing = [n for n in shapes if n not in self.shapes]
        if missing:
            raise CheckpointError(
                f"checkpoint {self.folder} lacks tensor '{missing[0]}' of the model"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        extra = [n for n in self.shapes if n not in shapes]
        if extra:
            raise CheckpointError(
                f"checkpoint {self.folder} has tensor '{extra[0]}' that the model does not train"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            )
        for name, shape in shapes.items():
            if tuple(self.shapes[name]) != tuple(shape):
                raise CheckpointError(
                    f"tensor '{name}' has shape {tuple(self.shapes[name])} in checkpoint "
                    f"{self.folder} but {tuple(shape)} in the model"
                )
        if len(self.group_names) != len(group_names):
            raise CheckpointError(
                f"checkpoint {self.folder} has {len(self.group_names)} param groups, the optimizer {len(group_names)}"
            )
        for g, (theirs, ours) in enumerate(zip(self.group_names, group_names)):
            if set(theirs) != set(ours):
                moved = sorted(set(theirs) ^ set(ours))[0]
                raise CheckpointError(
                    f"tensor '{moved}' is in another param group in checkpoint {self.folder} "
                    f"than in the optimizer (group {g})"
                )


def hyper_parameters(group: Mapping[str, Any]) -> dict:
    """A param group's hyper-parameters: all but ``params`` (and DeepSpeed's per-group ``step``)."""
    return {k: v for k, v in group.items() if k not in ("params", "step")}


def read_model_states(folder: str, mp_rank: int = 0) -> dict:
    """The checkpoint's module file of model-parallel rank ``mp_rank`` (checked against its digest, memory-mapped)."""
    path = os.path.join(folder, model_states_name(mp_rank))
    if mp_rank and not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint {folder} has no {model_states_name(mp_rank)}: it was saved with "
            f"{len(mp_ranks(folder))} model-parallel rank(s); resume with the same tensor-parallel size"
        )
    if not os.path.isfile(path) and os.path.isfile(os.path.join(folder, STOCK_ZERO3_MODEL_STATES)):
        raise CheckpointError(
            f"checkpoint {folder} is a stock ZeRO-3 checkpoint ({STOCK_ZERO3_MODEL_STATES}, no {MODEL_STATES}), "
            "which ds_tensorshard does not load as it is; `ds-tensorshard convert-checkpoint SAVE_DIR OUT_DIR "
            "--to tensorshard` writes it in ds_tensorshard's layout (loadable at any world size and stage)"
        )
    files.verify(path)
    return files.load(path)


def rank_files(folder: str, world_size: int, mp_rank: int) -> list[str]:
    """The optimizer file of each data-parallel rank ``0..world_size-1`` of model-parallel rank ``mp_rank``."""
    found: dict[int, str] = {}
    for entry in sorted(os.listdir(folder)):
        ranks = parse_rank_file_name(entry)
        if ranks is not None and ranks[1] == mp_rank and ranks[0] < world_size:
            found.setdefault(ranks[0], os.path.join(folder, entry))
    for rank in range(world_size):
        if rank not in found:
            raise CheckpointError(
                f"checkpoint {folder} was saved by {world_size} ranks but the optimizer file of "
                f"rank {rank} ({rank_file_name(rank, bf16=False, mp_rank=mp_rank)}, or with the "
                "bf16_ prefix) is missing"
            )
    return [found[r] for r in range(world_size)]


def open_checkpoint(
    folder: str, universal: bool = False, mp_rank: int = 0, model_states: dict | None = None
) -> CheckpointSource:
    """Open and check model-parallel rank ``mp_rank``'s part of the checkpoint in ``folder`` (``<save_dir>/<tag>``);
    ``model_states``: its module file where the caller has read it already (:func:`read_model_states`)."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    states = read_model_states(folder, mp_rank) if model_states is None else model_states
    return _open(folder, states, universal, mp_rank)


def _open(folder: str, model_states: dict, universal: bool, mp_rank: int) -> CheckpointSource:
    if universal:
        if len(mp_ranks(folder)) > 1:
            raise CheckpointError(
                f"universal checkpoint {folder} has several model-parallel ranks; ds_tensorshard "
                "loads universal checkpoints without tensor parallelism only"
            )
        source: CheckpointSource = UniversalSource(folder, model_states)
    else:
        world_size = int(model_states.get("dp_world_size", 1))
        paths = rank_files(folder, world_size, mp_rank)
        for path in paths:
            files.verify(path)
        first = files.load(paths[0]).get("optimizer_state_dict")
        if not isinstance(first, Mapping):
            raise CheckpointError(f"{paths[0]} holds no optimizer state")
        if RankFile.holds(first):
            source = TensorShardSource(folder, model_states, paths, model_states_name(mp_rank))
        elif "single_partition_of_fp32_groups" in first:
            source = ZeroSource(folder, model_states, paths, model_states_name(mp_rank))
        else:
            raise CheckpointError(f"{paths[0]} is neither a ds_tensorshard nor a stock ZeRO-1/2 optimizer file")
    source.model_states = model_states
    return source


class TensorShardSource(CheckpointSource):
    """ds_tensorshard's own layout: each rank file holds whole tensors, keyed by parameter name."""

    kind = "tensorshard"

    def __init__(self, folder: str, model_states: Mapping, paths: list[str], states_name: str) -> None:
        self.folder, self.paths, self.world_size = folder, paths, len(paths)
        expected_id = model_states.get(CHECKPOINT_ID_KEY)
        self.where: dict[str, list[int]] = {}
        self.kept_where: dict[str, list[int]] = {}
        self.kept_shapes: dict[str, tuple[int, ...]] = {}
        covered: dict[str, int] = {}
        for rank, path in enumerate(paths):
            saved = self._read(path)
            if saved.checkpoint_id != expected_id:
                raise CheckpointError(
                    f"{path} comes from another save than {states_name} in {folder} "
                    "(an interrupted save); load an earlier tag"
                )
            if saved.world_size != self.world_size or saved.rank != rank:
                raise CheckpointError(f"{path} was written as rank {saved.rank} of {saved.world_size}")
            for name in saved.tensors:
                self.where.setdefault(name, []).append(rank)
            for name, entry in saved.parameters.items():
                self.kept_where.setdefault(name, []).append(rank)
                self.kept_shapes[name] = tuple(entry["shape"])
                covered[name] = covered.get(name, 0) + int(entry["value"].numel())
            if rank == 0:
                self.group_names = saved.group_names
                self.shapes = saved.shapes
                self.param_groups = saved.param_groups
                self.scaler = ScalerState(
                    saved.loss_scaler or None, bool(saved.loss_scaler.get("dynamic")), saved.overflow, saved.clip_grad
                )
        orphan = next((n for n in self.shapes if n not in self.where), None)
        if orphan is not None:
            raise CheckpointError(f"tensor '{orphan}' is in no rank file of checkpoint {folder}")
        for name, shape in self.kept_shapes.items():
            if covered[name] != math.prod(shape):
                raise CheckpointError(
                    f"the blocks of parameter '{name}' in checkpoint {folder} cover {covered[name]} of its "
                    f"{math.prod(shape)} elements"
                )

    @staticmethod
    def _read(path: str) -> RankFile:
        return RankFile.from_dict(files.load(path)["optimizer_state_dict"], path)

    def kept_shape(self, name: str) -> tuple[int, ...] | None:
        return self.kept_shapes.get(name)

    def kept_parameter(self, name: str) -> torch.Tensor | None:
        """The untrained parameter's value, whole, assembled from its blocks where the saving plan split it."""
        if name not in self.kept_where:
            return None
        shape = self.kept_shapes[name]
        numel = math.prod(shape)
        value: torch.Tensor | None = None
        for rank in self.kept_where[name]:
            entry = self._read(self.paths[rank]).parameters[name]
            start, stop = entry.get("block", (0, numel))
            if value is None:
                value = torch.empty(numel, dtype=entry["value"].dtype, device="cpu")
            value[start:stop].copy_(entry["value"].reshape(-1))
        assert value is not None, "a kept parameter is in some rank file"
        return value.view(shape)

    def master(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(self.where[name]) == 1:
            entry = self._read(self.paths[self.where[name][0]]).tensors[name]
            if "block" not in entry:
                return entry["master"].clone().view(shape)
        return self.tensor(name).master

    def tensor(self, name: str) -> TensorState:
        """The whole tensor's state, assembled from its blocks where the saving plan split it."""
        shape = self.shapes[name]
        numel = math.prod(shape)
        master, covered = torch.empty(numel, dtype=torch.float32, device="cpu"), 0
        state: dict[str, Any] = {}
        for rank in self.where[name]:
            entry = dict(self._read(self.paths[rank]).tensors[name])
            start, stop = entry.pop("block", (0, numel))
            covered += stop - start
            master[start:stop].copy_(entry.pop("master").reshape(-1))
            for key, value in entry.items():
                if torch.is_tensor(value) and value.numel() == stop - start and (start, stop) != (0, numel):
                    part = state.setdefault(key, torch.empty(numel, dtype=value.dtype, device="cpu"))
                    part[start:stop].copy_(value.reshape(-1))
                elif key not in state:
                    state[key] = value.clone() if torch.is_tensor(value) else value
        if covered != numel:
            raise CheckpointError(
                f"the blocks of tensor '{name}' in checkpoint {self.folder} cover {covered} of its {numel} elements"
            )
        return TensorState(
            master.view(shape),
            {k: v.view(shape) if torch.is_tensor(v) and v.numel() == numel else v for k, v in state.items()},
        )


class ZeroSource(CheckpointSource):
    """Stock ZeRO-1/2: per group, one flat fp32 buffer split evenly over the ranks (any world size). With MoE
    layers, an expert group's buffer holds one expert-parallel rank's experts (``param_shapes`` names rank 0's, by
    local index), split over that rank's expert-data-parallel group: ranks ``e, e + ep, e + 2 ep, ...`` of
    expert-parallel rank ``e`` (DeepSpeed's groups); its tensors are named here by global expert index."""

    kind = "zero"

    def __init__(self, folder: str, model_states: Mapping, paths: list[str], states_name: str) -> None:
        self.folder, self.paths, self.world_size = folder, paths, len(paths)
        param_shapes = model_states.get("param_shapes")
        if not param_shapes:
            raise CheckpointError(f"{os.path.join(folder, states_name)} has no param_shapes")
        self.sizes: list[list[int]] = []  # [rank][group] elements of the rank's (unpadded) partition
        for rank, path in enumerate(paths):
            state = files.load(path)["optimizer_state_dict"]
            counts = [int(c) for c in state.get("partition_count", [self.world_size])]
            self.sizes.append([int(p.numel()) for p in state["single_partition_of_fp32_groups"]])
            if rank == 0:
                base = state["base_optimizer_state"]
                # elastic_checkpoint files keep no hyper-parameters: the optimizer's own stay
                self.param_groups = (
                    [hyper_parameters(g) for g in base["param_groups"]] if isinstance(base, Mapping) else []
                )
                self.scaler = scaler_state(state)
                self.paddings = state.get("param_alignment_paddings")
                self.counts = counts
            moe = [bool(g.get("moe")) for g in self.param_groups] or [False] * len(counts)
            if any(c != self.world_size and not (m and self.world_size % c == 0) for c, m in zip(counts, moe)):
                raise CheckpointError(f"{path} is partitioned {counts} ways, not over {self.world_size} ranks")
        self.group_names: list[list[str]] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        # name -> (group, start in the group's flat buffer, the ranks holding that buffer in order)
        self.offsets: dict[str, tuple[int, int, list[int]]] = {}
        for g, group in enumerate(param_shapes):
            ep = self.world_size // self.counts[g]
            holders = [[e + j * ep for j in range(self.counts[g])] for e in range(ep)]
            names: list[str] = []
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                for e, ranks in enumerate(holders):
                    named = expert_name(name, group, e) if ep > 1 else name
                    self.offsets[named] = (g, offset, ranks)
                    self.shapes[named] = tuple(shape)
                    names.append(named)
                offset += int(torch.Size(shape).numel())
                if self.paddings:
                    offset += int(self.paddings[g][i])
            self.group_names.append(names)

    def _flat_range(self, g: int, start: int, numel: int, ranks: list[int], pick) -> torch.Tensor:
        """Elements ``start:start+numel`` of group ``g``'s flat buffer (``pick`` from a rank's file), in its saved
        dtype (fp32; bf16 with stock's bf16_master_weights_and_grads and bf16_optimizer_states)."""
        out: torch.Tensor | None = None
        rank_start = 0
        for rank in ranks:
            size = self.sizes[rank][g]
            lo, hi = max(start, rank_start), min(start + numel, rank_start + size)
            if lo < hi:
                flat = pick(files.load(self.paths[rank])["optimizer_state_dict"], g)
                if out is None:
                    out = torch.empty(numel, dtype=flat.dtype, device="cpu")
                out[lo - start : hi - start].copy_(flat[lo - rank_start : hi - rank_start])
            rank_start += size
        if start + numel > rank_start:
            raise CheckpointError(f"the flat buffers of checkpoint {self.folder} are shorter than its param_shapes")
        return out if out is not None else torch.empty(0, dtype=torch.float32, device="cpu")  # a 0-element tensor

    def tensor(self, name: str) -> TensorState:
        g, start, ranks = self.offsets[name]
        shape = self.shapes[name]
        numel = int(torch.Size(shape).numel())
        first = files.load(self.paths[ranks[0]])["optimizer_state_dict"]
        group_state = _base_state(first, g)
        master = self._flat_range(g, start, numel, ranks, lambda s, g: s["single_partition_of_fp32_groups"][g])
        keys = [k for k, v in group_state.items() if torch.is_tensor(v) and v.dim() == 1]  # flat per-element state
        state: dict[str, Any] = {
            k: self._flat_range(g, start, numel, ranks, lambda s, g, k=k: _base_state(s, g)[k]).view(shape)
            for k in keys
        }
        if state or "step" in group_state:
            state["step"] = step_int(first.get("base_optimizer_state_step", group_state.get("step", 0)))
        return TensorState(master.view(shape), state)


def _base_state(state: Mapping, g: int) -> Mapping:
    base = state["base_optimizer_state"]
    if isinstance(base, Mapping):  # torch state_dict of the flat optimizer
        return base["state"].get(g, {})
    return base[g]  # elastic_checkpoint: a list of per-group dicts


class UniversalSource(CheckpointSource):
    """DeepSpeed universal checkpoint: ``zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt``."""

    kind = "universal"

    def __init__(self, folder: str, model_states: Mapping) -> None:
        self.folder, self.world_size = folder, int(model_states.get("dp_world_size", 1))
        self.zero = os.path.join(folder, "zero")
        state = (
            files.load(os.path.join(self.zero, "optimizer_state.pt"))
            if os.path.isfile(os.path.join(self.zero, "optimizer_state.pt"))
            else None
        )
        if state is None:
            raise CheckpointError(
                f"{os.path.join(self.zero, 'optimizer_state.pt')} is missing: not a universal checkpoint"
            )
        param_shapes = model_states["param_shapes"]
        self.group_names = [list(group) for group in param_shapes]
        self.shapes = {n: tuple(s) for group in param_shapes for n, s in group.items()}
        self.param_groups = [hyper_parameters(g) for g in state["param_groups"]]
        self.scaler = scaler_state(state)
        missing = next((n for n in self.shapes if not os.path.isfile(os.path.join(self.zero, n, "fp32.pt"))), None)
        if missing is not None:
            raise CheckpointError(f"universal checkpoint {folder} lacks {os.path.join(self.zero, missing, 'fp32.pt')}")

    def _part(self, name: str, key: str) -> torch.Tensor | None:
        path = os.path.join(self.zero, name, f"{key}.pt")
        if not os.path.isfile(path):
            return None
        value = files.load(path)
        return (value["param"] if isinstance(value, Mapping) else value).clone().view(self.shapes[name])

    def tensor(self, name: str) -> TensorState:
        state: dict[str, Any] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            value = self._part(name, key)
            if value is not None:
                state[key] = value
        step_path = os.path.join(self.zero, name, "step.pt")
        if state:
            state["step"] = step_int(files.load(step_path)) if os.path.isfile(step_path) else 0
        master = self._part(name, "fp32")
        if master is None:
            raise CheckpointError(f"universal checkpoint lacks {os.path.join(self.zero, name, 'fp32.pt')}")
        return TensorState(master, state)
