"""One state dict of the whole model from a checkpoint, streamed: each tensor is read when it is written.

:func:`lazy_state_dict` lists every entry of the consolidated state dict (its name, shape and dtype, known from
the checkpoint's metadata) as a :class:`LazyTensor` that reads the tensor on ``contiguous()``, the contract of
DeepSpeed's ``zero_to_fp32`` ``lazy_mode``. :func:`write_safetensors` writes such a dict into one safetensors file
or shards of at most ``max_shard_size`` bytes (with Hugging Face's ``model.safetensors.index.json``), one tensor in
memory at a time: a safetensors header needs only names, dtypes and shapes, so it is written first and each tensor's
bytes follow. :func:`write_torch` writes ``pytorch_model.bin`` files, each shard built in memory (``torch.save``
pickles a whole dict).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Mapping
from typing import BinaryIO

import torch

from ds_tensorshard.checkpoints.files import replace_durably, save_atomic, write_text_atomic
from ds_tensorshard.checkpoints.saved_module import SavedModule
from ds_tensorshard.checkpoints.sources import CheckpointSource
from ds_tensorshard.errors import CheckpointError

Progress = Callable[[int, int], None]
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LazyTensor:
    """A tensor of the consolidated state dict, read (and cast to ``dtype``) on :meth:`contiguous`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[], torch.Tensor]) -> None:
        self.shape, self.dtype, self._read = torch.Size(shape), dtype, read

    def contiguous(self) -> torch.Tensor:
        return self._read().to(self.dtype).reshape(self.shape).contiguous()

    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize


def in_stock_order(out: dict, model_states: Mapping, buffers: set[str]) -> dict:
    """``out`` in the order of DeepSpeed's zero_to_fp32: the buffers, the frozen parameters, the trained ones group
    by group (the module file's ``param_shapes``), then whatever else (an expert's tensors) as it came."""
    trained = [name for group in model_states.get("param_shapes") or () for name in group]
    order = [name for name in out if name in buffers] + list(model_states.get("frozen_param_shapes") or ()) + trained
    first = {name: i for i, name in enumerate(dict.fromkeys(order))}
    return dict(sorted(out.items(), key=lambda item: first.get(item[0], len(first))))


def _upcast(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _saved_value(saved: SavedModule, name: str) -> torch.Tensor:
    value = saved.value(name)
    if value is None:
        raise CheckpointError(f"checkpoint {saved.folder} has no value of '{name}'")
    return value


def lazy_state_dict(source: CheckpointSource, exclude_frozen: bool = False) -> dict[str, LazyTensor]:
    """What ``convert-checkpoint --to fp32`` writes, unread: trained tensors from the fp32 masters; frozen tensors
    (left out with ``exclude_frozen``, as zero_to_fp32's ``exclude_frozen_parameters``) and buffers from the saved
    module (a stage-3 save's from the rank files that keep them), floating ones as fp32; with MoE layers every
    expert's tensors, keyed by global expert index; a tied alias is its owner's object. DeepSpeed's order."""
    saved = SavedModule(source)
    states = source.model_states
    buffers = set(states.get("buffer_names") or ())
    aliases = dict(states.get("shared_params") or {})
    out: dict[str, LazyTensor] = {}
    for name, value in (states.get("module") or {}).items():
        if name in aliases or name in source.shapes or not torch.is_tensor(value):
            continue
        if name in buffers or not exclude_frozen:
            if name in saved.placeholders:
                shape = saved.shape(name)
                if shape is not None:
                    out[name] = LazyTensor(shape, _upcast(value.dtype), functools.partial(_saved_value, saved, name))
            else:  # the module file's own tensor (memory-mapped): a copy
                out[name] = LazyTensor(tuple(value.shape), _upcast(value.dtype), value.clone)
    for name, shape in source.shapes.items():
        out[name] = LazyTensor(shape, torch.float32, functools.partial(source.master, name))
    out = in_stock_order(out, states, buffers)
    for alias, owner in aliases.items():
        if owner in out:
            out[alias] = out[owner]
    return out


def materialize(lazy: Mapping[str, LazyTensor], progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every tensor read (a tied alias the same tensor as its owner's)."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    for i, (name, tensor) in enumerate(lazy.items(), 1):
        if id(tensor) not in done:
            done[id(tensor)] = tensor.contiguous()
        out[name] = done[id(tensor)]
        if progress is not None:
            progress(i, len(lazy))
    return out


def cast(lazy: Mapping[str, LazyTensor], dtype: str) -> dict[str, LazyTensor]:
    """``lazy`` with its floating tensors read as ``dtype`` (fp32, bf16, fp16); a tied alias still its owner's."""
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}: one of {sorted(DTYPES)}")
    made: dict[int, LazyTensor] = {}
    for tensor in lazy.values():
        if id(tensor) not in made:
            wanted = DTYPES[dtype] if tensor.dtype.is_floating_point else tensor.dtype
            made[id(tensor)] = LazyTensor(tuple(tensor.shape), wanted, tensor._read)
    return {name: made[id(tensor)] for name, tensor in lazy.items()}


def write_consolidated(
    lazy: Mapping[str, LazyTensor],
    out_dir: str,
    dtype: str = "fp32",
    safetensors: bool = True,
    max_shard_size: int | str | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """``lazy`` cast to ``dtype`` into ``out_dir``: safetensors (streamed) or ``pytorch_model.bin`` files."""
    write = write_safetensors if safetensors else write_torch
    return write(cast(lazy, dtype), out_dir, max_shard_size, progress)


def parse_size(size: int | str) -> int:
    """Bytes of a shard size given as a number or as Hugging Face writes it (``"5GB"``, ``"500MB"``, ``"2GiB"``)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*((?:[KMGT]i?)?B)?\s*", size, re.IGNORECASE)
    if not match:
        raise CheckpointError(f"shard size {size!r} is not a number of bytes nor like '5GB' or '500MB'")
    unit = (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** " KMGT".index(unit[0] if unit != "B" else " "))


def shards(lazy: Mapping[str, LazyTensor], max_bytes: int | None) -> list[list[str]]:
    """The names of each shard, in order, a new shard begun where the next tensor would pass ``max_bytes``."""
    out: list[list[str]] = [[]]
    size = 0
    for name, tensor in lazy.items():
        if max_bytes is not None and out[-1] and size + tensor.nbytes() > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += tensor.nbytes()
    return out


def _shard_names(stem: str, ext: str, count: int) -> list[str]:
    if count == 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]


def _safetensors_header(lazy: Mapping[str, LazyTensor], names: list[str]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        tensor = lazy[name]
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor '{name}' is {tensor.dtype}, which safetensors does not hold")
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes()],
        }
        offset += tensor.nbytes()
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors' own writer pads it


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def _write_shard(path: str, lazy: Mapping[str, LazyTensor], names: list[str], progress: Callable[[], None]) -> None:
    def write(tmp: str) -> None:
        header = _safetensors_header(lazy, names)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for name in names:
                _write_tensor(f, lazy[name].contiguous())  # the only tensor held
                progress()

    replace_durably(write, path)


def _index(
    out_dir: str, index_name: str, lazy: Mapping[str, LazyTensor], groups: list[list[str]], files: list[str]
) -> None:
    """Hugging Face's index of a sharded state dict: the total size and each tensor's file."""
    weight_map = {name: file for file, names in zip(files, groups) for name in names}
    total = sum(lazy[name].nbytes() for name in weight_map)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    write_text_atomic(os.path.join(out_dir, index_name), text + "\n")


def write_safetensors(
    lazy: Mapping[str, LazyTensor],
    out_dir: str,
    max_shard_size: int | str | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` and the index) in ``out_dir``; a tied alias
    is written as its own entry (safetensors holds no shared tensors). Returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    groups = shards(lazy, None if max_shard_size is None else parse_size(max_shard_size))
    names = _shard_names("model", "safetensors", len(groups))
    done = [0]

    def advance() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], len(lazy))

    for name, group in zip(names, groups):
        _write_shard(os.path.join(out_dir, name), lazy, group, advance)
    if len(groups) > 1:
        _index(out_dir, "model.safetensors.index.json", lazy, groups, names)
    return [os.path.join(out_dir, n) for n in names]


def write_torch(
    lazy: Mapping[str, LazyTensor],
    out_dir: str,
    max_shard_size: int | str | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """``pytorch_model.bin`` (or ``pytorch_model-0000i-of-0000n.bin`` and the index) in ``out_dir``, one shard's
    tensors in memory at a time (a tied alias shares its owner's tensor within a shard)."""
    os.makedirs(out_dir, exist_ok=True)
    groups = shards(lazy, None if max_shard_size is None else parse_size(max_shard_size))
    names = _shard_names("pytorch_model", "bin", len(groups))
    for name, group in zip(names, groups):
        save_atomic(materialize({n: lazy[n] for n in group}, progress), os.path.join(out_dir, name))
    if len(groups) > 1:
        _index(out_dir, "pytorch_model.bin.index.json", lazy, groups, names)
    return [os.path.join(out_dir, n) for n in names]
