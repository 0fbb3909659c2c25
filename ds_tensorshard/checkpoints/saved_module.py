"""A checkpoint's module values by name, each whole, whichever ZeRO stage saved them.

At stages 1/2 (ds_tensorshard's and stock ZeRO-1/2's) the module file holds every parameter whole. A stage-3 save
of ds_tensorshard holds each parameter once, where its owner keeps it: its module file has DeepSpeed's stage-3
``module_state_dict``, an empty placeholder per parameter (shape ``(0,)``, the parameter's dtype; buffers whole),
the trained parameters are their fp32 masters in the rank files (as at stages 1/2), the others (frozen) their
owners' tensors (the rank files' ``parameters``). :class:`SavedModule` finds each by name, so a stage-3 engine
loads a stage-1/2 save and a stage-1/2 engine a stage-3 save (:meth:`SavedModule.completed`).

Example: TinyGPT saved at stage 3 has ``module["wte.weight"]`` of shape ``(0,)``; ``value("wte.weight")`` is its
master from the rank file of the rank that owned it, ``value("head.weight")`` (tied to it, ``shared_params``) the
same tensor, ``value("frozen_scale")`` its owner's ``parameters`` entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ds_tensorshard.checkpoints.sources import CheckpointSource
from ds_tensorshard.datapath.shapes import shape_of
from ds_tensorshard.errors import CheckpointError


def recorded_shapes(model_states: Mapping) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole shape as the module file records it: the trained ones' (``param_shapes``), the
    others' (``frozen_param_shapes``), a tied alias its owner's (``shared_params``)."""
    shapes = {n: tuple(s) for group in model_states.get("param_shapes") or () for n, s in group.items()}
    shapes.update({n: tuple(s) for n, s in (model_states.get("frozen_param_shapes") or {}).items()})
    for alias, owner in (model_states.get("shared_params") or {}).items():
        if owner in shapes:
            shapes[alias] = shapes[owner]
    return shapes


def placeholder_names(model_states: Mapping) -> list[str]:
    """The module entries that are empty placeholders of non-empty parameters (a stage-3 save's)."""
    shapes = recorded_shapes(model_states)
    return [
        name
        for name, value in (model_states.get("module") or {}).items()
        if torch.is_tensor(value) and value.numel() == 0 and math.prod(shapes.get(name, (0,))) > 0
    ]


def expected_module(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """What a module's state dict holds, by name, with each parameter's whole shape (also while released)."""
    return {name: shape_of(value) for name, value in module.state_dict(keep_vars=True).items()}


class SavedModule:
    """The module values of an opened checkpoint (``source``), by name."""

    def __init__(self, source: CheckpointSource) -> None:
        states = source.model_states
        self.source, self.folder = source, source.folder
        self.entries: Mapping[str, object] = states.get("module") or {}
        self.aliases: dict[str, str] = dict(states.get("shared_params") or {})
        self.placeholders = set(placeholder_names(states))

    def _whole_entry(self, name: str) -> torch.Tensor | None:
        entry = self.entries.get(name)
        return entry if torch.is_tensor(entry) and name not in self.placeholders else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The whole shape of the saved value of ``name`` (None: the checkpoint holds no value of it)."""
        entry = self._whole_entry(name)
        if entry is not None:
            return tuple(entry.shape)
        owner = self.aliases.get(name, name)
        if owner in self.source.shapes:
            return tuple(self.source.shapes[owner])
        return self.source.kept_shape(owner)

    def value(self, name: str) -> torch.Tensor | None:
        """The saved value of ``name``, whole: the module file's entry, else (a stage-3 save) the trained
        parameter's fp32 master or the untrained one's kept tensor; None where the checkpoint has none."""
        entry = self._whole_entry(name)
        if entry is not None:
            return entry
        owner = self.aliases.get(name, name)
        if owner in self.source.shapes:
            return self.source.tensor(owner).master
        return self.source.kept_parameter(owner)

    def check(self, expected: Mapping[str, tuple[int, ...]], strict: bool) -> None:
        """Refuse, naming the tensor and before any state is touched, a value of another shape than the model's,
        and with ``strict`` one the model has and the checkpoint lacks or the reverse (torch's strict load)."""
        for name, shape in expected.items():
            saved = self.shape(name)
            if saved is None and strict:
                raise CheckpointError(f"checkpoint {self.folder} has no value of '{name}' of the model")
            if saved is not None and tuple(saved) != tuple(shape):
                raise CheckpointError(
                    f"'{name}' has shape {tuple(saved)} in checkpoint {self.folder} but {tuple(shape)} in the model"
                )
        extra = [name for name in self.entries if name not in expected]
        if strict and extra:
            raise CheckpointError(f"checkpoint {self.folder} has '{extra[0]}', which the model does not have")

    def completed(self) -> dict:
        """The module file's state dict, each placeholder replaced by its whole value in the placeholder's dtype
        (what a stage-1/2 engine loads); a placeholder of no saved value is left out (a non-strict load)."""
        out = dict(self.entries)
        for name in self.placeholders:
            value = self.value(name)
            if value is None:
                del out[name]
            else:
                out[name] = value.to(dtype=out[name].dtype)  # type: ignore[attr-defined]
        return out
