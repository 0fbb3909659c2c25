"""Reader of a stock ZeRO-3 checkpoint folder (DeepSpeed 0.19's layout), any saved world size.

Each rank ``r`` of ``n`` writes ``zero_pp_rank_r_mp_rank_XX_model_states.pt`` (the module with an empty placeholder
per parameter, the buffers whole, ``param_shapes`` per sub-group, ``frozen_param_shapes``, and its own share of each
frozen parameter, ``frozen_param_fragments``) and ``[bf16_]zero_pp_rank_r_mp_rank_XX_optim_states.pt``, whose
``optimizer_state_dict`` holds one flat fp32 partition per sub-group (``fp32_flat_groups``) and the inner optimizer's
``state_dict`` over those flats (state ``i`` is sub-group ``i``'s, its ``param_groups`` list the sub-groups of each
param group). Every parameter of ``numel`` elements is cut into ``n`` pieces of ``ceil(numel / n)``; rank ``r``
keeps piece ``r`` (zero-padded on the last ranks), and a sub-group's flat is its parameters' pieces in order.

:class:`Zero3Source` hands out one whole tensor at a time, reading that tensor's piece from every rank's file
(memory-mapped), as the other readers of :mod:`.sources` do.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from ds_tensorshard.checkpoints import files
from ds_tensorshard.checkpoints.rank_file import step_int
from ds_tensorshard.checkpoints.sources import CheckpointSource, TensorState, hyper_parameters, rank_files, scaler_state
from ds_tensorshard.errors import CheckpointError

FROZEN_FRAGMENTS = "frozen_param_fragments"


def zero3_model_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    """Stock ZeRO-3's name for a rank's module file."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def is_stock_zero3(folder: str) -> bool:
    """Whether a tag folder holds a stock ZeRO-3 checkpoint (per-rank module files, no ``mp_rank_00_model_states``)."""
    return os.path.isfile(os.path.join(folder, zero3_model_states_name(0))) and not os.path.isfile(
        os.path.join(folder, "mp_rank_00_model_states.pt")
    )


def zero3_mp_ranks(folder: str) -> list[int]:
    """The model-parallel ranks a stock ZeRO-3 folder holds module files of."""
    found = (re.match(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$", entry) for entry in os.listdir(folder))
    return sorted(int(match.group(1)) for match in found if match)


def piece(numel: int, world_size: int) -> int:
    """The elements of each rank's piece of a ``numel``-element parameter (the last pieces zero-padded)."""
    return -(-numel // world_size)


class Zero3Source(CheckpointSource):
    """Stock ZeRO-3: per sub-group a flat fp32 partition on each rank, each parameter in equal pieces."""

    kind = "zero3"

    def __init__(self, folder: str, mp_rank: int = 0) -> None:
        self.folder, self.mp_rank = folder, mp_rank
        states_path = os.path.join(folder, zero3_model_states_name(0, mp_rank))
        files.verify(states_path)
        states = files.load(states_path)
        self.world_size = int(states.get("dp_world_size", 1))
        self.state_paths = [os.path.join(folder, zero3_model_states_name(r, mp_rank)) for r in range(self.world_size)]
        for path in self.state_paths:
            files.verify(path)
        self.paths = rank_files(folder, self.world_size, mp_rank)
        first = self._optimizer(0)
        if int(first.get("zero_stage", 0)) != 3 or "fp32_flat_groups" not in first:
            raise CheckpointError(f"{self.paths[0]} is not a stock ZeRO-3 optimizer file (no fp32_flat_groups)")
        if int(first.get("partition_count", self.world_size)) != self.world_size:
            raise CheckpointError(
                f"{self.paths[0]} is partitioned {first['partition_count']} ways, not {self.world_size}"
            )
        inner = first["optimizer_state_dict"]
        self.param_groups = [hyper_parameters(g) for g in inner["param_groups"]]
        self.scaler = scaler_state(first)
        self._locate(states, inner, [int(t.numel()) for t in first["fp32_flat_groups"]])
        self.frozen_shapes = {n: tuple(s) for n, s in (states.get("frozen_param_shapes") or {}).items()}
        self.model_states = {k: v for k, v in states.items() if k != FROZEN_FRAGMENTS}

    def _optimizer(self, rank: int) -> Mapping[str, Any]:
        return files.load(self.paths[rank])["optimizer_state_dict"]

    def _locate(self, states: Mapping, inner: Mapping, flat_sizes: list[int]) -> None:
        """Each trained tensor's sub-group and offset in it; the tensors of each param group in order."""
        sub_shapes = states.get("param_shapes") or []
        if len(sub_shapes) != len(flat_sizes):
            raise CheckpointError(
                f"{self.state_paths[0]} has {len(sub_shapes)} sub-groups in param_shapes, "
                f"{self.paths[0]} {len(flat_sizes)} flat partitions"
            )
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (sub-group, offset in its flat partition)
        for sub, shapes in enumerate(sub_shapes):
            offset = 0
            for name, shape in shapes.items():
                self.shapes[name], self.offsets[name] = tuple(shape), (sub, offset)
                offset += piece(math.prod(shape), self.world_size)
            if offset != flat_sizes[sub]:
                raise CheckpointError(
                    f"sub-group {sub} of {self.paths[0]} holds {flat_sizes[sub]} elements, its param_shapes {offset}"
                )
        subs = [[int(i) for i in group["params"]] for group in inner["param_groups"]]
        if sorted(i for ids in subs for i in ids) != list(range(len(sub_shapes))):
            raise CheckpointError(f"the param groups of {self.paths[0]} do not list its sub-groups once each")
        self.group_names = [[name for i in ids for name in sub_shapes[i]] for ids in subs]

    def _pieces(self, name: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The whole tensor ``name`` of each of ``keys`` ("master", or a flat optimizer-state key), from its pieces."""
        sub, offset = self.offsets[name]
        numel = math.prod(self.shapes[name])
        size = piece(numel, self.world_size)
        out = {key: torch.empty(numel, dtype=torch.float32, device="cpu") for key in keys}
        for rank in range(self.world_size):
            lo, hi = rank * size, min(numel, (rank + 1) * size)
            if lo >= hi:
                break
            saved = self._optimizer(rank)
            for key, whole in out.items():
                flat = (
                    saved["fp32_flat_groups"][sub]
                    if key == "master"
                    else saved["optimizer_state_dict"]["state"][sub][key]
                )
                whole[lo:hi].copy_(flat[offset : offset + hi - lo])
        return {key: value.view(self.shapes[name]) for key, value in out.items()}

    def master(self, name: str) -> torch.Tensor:
        return self._pieces(name, ("master",))["master"]

    def tensor(self, name: str) -> TensorState:
        sub, _ = self.offsets[name]
        group_state = self._optimizer(0)["optimizer_state_dict"]["state"].get(sub, {})
        keys = tuple(k for k, v in group_state.items() if torch.is_tensor(v) and v.dim() == 1)
        whole = self._pieces(name, ("master", *keys))
        state: dict[str, Any] = {k: whole[k] for k in keys}
        if "step" in group_state:
            state["step"] = step_int(group_state["step"])
        return TensorState(whole["master"], state)

    def kept_shape(self, name: str) -> tuple[int, ...] | None:
        return self.frozen_shapes.get(name)

    def kept_parameter(self, name: str) -> torch.Tensor | None:
        """A frozen parameter, whole, from every rank's ``frozen_param_fragments``."""
        if name not in self.frozen_shapes:
            return None
        shape = self.frozen_shapes[name]
        numel = math.prod(shape)
        size = piece(numel, self.world_size)
        value: torch.Tensor | None = None
        for rank, path in enumerate(self.state_paths):
            lo, hi = rank * size, min(numel, (rank + 1) * size)
            if lo >= hi:
                break
            fragment = files.load(path)[FROZEN_FRAGMENTS][name].reshape(-1)
            if value is None:
                value = torch.empty(numel, dtype=fragment.dtype, device="cpu")
            value[lo:hi].copy_(fragment[: hi - lo])
        return value.view(shape) if value is not None else torch.empty(shape, device="cpu")
