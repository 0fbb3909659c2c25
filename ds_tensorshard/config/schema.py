"""The ``"tensorshard"`` block: its keys (``TensorShardConfig``, whose field docstrings are the README's table)
and how they are read, from the DeepSpeed config or from the environment switch."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ds_tensorshard.errors import TensorShardConfigError

BLOCK = "tensorshard"
ENV_SWITCH, ENV_CONFIG = "DS_TENSORSHARD", "DS_TENSORSHARD_CONFIG"  # turn the plugin on for configs built in code


class TensorShardConfig(BaseModel):
    """Keys of the top-level ``"tensorshard"`` block."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Turn tensor-granular sharding on. Off: DeepSpeed runs exactly as stock."""

    comm_backend: Literal["torch", "mpi"] = "torch"
    """Transport for the plugin's collectives: ``"torch"`` = ``deepspeed.comm`` (gloo on CPU, NCCL on GPU);
    ``"mpi"`` = mpi4py. A window moves with one reduce-scatter of the owners' parts and one broadcast from each
    owner on mpi, one reduce to and one broadcast from each owner on torch: nothing is padded."""

    shared_memory: bool = True
    """Where every rank of a group is on one host and the ranks are CPU ranks, the data path's collectives go through
    shared memory (/dev/shm): each rank writes its part, meets the others at a barrier of ``comm_backend`` and reads
    theirs, and flat parameters (``bucket_layout``) live in one storage they all map where /dev/shm has room for it.
    ``false``: through ``comm_backend`` alone. Accelerators and ranks on several hosts always take ``comm_backend``."""

    split_tensors: Literal["auto", "never"] = "auto"
    """``"auto"``: a tensor too large to fit whole within a rank's share (the whole-tensor plan's fullest
    rank above 1.02x the ideal) is owned in dim-0 blocks, each by one rank, only as many as needed;
    ``"never"``: every tensor is owned whole (the best whole-tensor balance)."""

    timeout_s: float = Field(default=1800.0, gt=0)
    """Deadline, in seconds, of each of the plugin's own collectives (a wait, not the whole step). When it
    passes, every rank that waits raises an error naming the step, the bucket and its first tensor, the
    transport and the ranks that have not arrived; under MPI the job is aborted so that mpiexec returns.
    The default is torch.distributed's own default timeout."""

    bucket_numel: int | None = Field(default=None, gt=0)
    """Elements per communication bucket (the largest flat buffer; a large tensor travels in pieces);
    ``null`` takes ``zero_optimization.reduce_bucket_size`` where the config sets it, else the size chosen with the
    layout (``"auto"``: see ``bucket_layout``; an explicit layout: 4,000,000, or the cost model's for stripes and
    flat on accelerators)."""

    bucket_layout: Literal["auto", "windows", "stripes", "flat"] = "auto"
    """``"windows"``: a bucket is ``bucket_numel`` consecutive elements of the gradient stream, moved by owner (as
    ``comm_backend`` says); ``"stripes"``: bucket ``k`` holds the ``k``-th ``bucket_numel / n`` elements of every rank's
    owned tensors, each rank's in its slot (padded to the fullest), and moves with one reduce-scatter and one all-gather
    (or all-reduces where faster) whatever the world size; ``"flat"``: the tensors laid end to end in model order in one
    storage of n equal slots, rank ``r`` owning slot ``r`` (a tensor across a slot boundary split there), the parameters
    views of it: gradients reduced by stripes, the parameters gathered by one collective of the storage in place, as
    stock; ``"auto"``: on CPU ranks of one host through shared memory (``shared_memory``) flat where nothing in the run
    rules it out (below), the storage one segment every rank maps, so the gather is a barrier; other CPU ranks the
    layout measured faster there (windows on torch/gloo; on mpi windows below 4 ranks, stripes from 4); both in
    4,000,000-element buckets; on accelerators (NCCL and the like) flat where nothing in the run rules it out
    (ZeRO-Offload, MoE expert groups, whole-matrix optimizers, ``split_tensors: "never"``, pipeline or tensor
    parallelism, initialize_many), else stripes, sized by the cost model: the most buckets predicted within 0.9x stock
    ZeRO-2's communication at its defaults, each within its 5e8-element bucket; a bucket size the config sets is kept.
    Rank 0's start-up line says what was chosen and why."""


def parse_block(param_dict: Mapping[str, Any]) -> TensorShardConfig:
    """Parse and validate the ``tensorshard`` block of a DeepSpeed config dict, or, where the config has none,
    what the environment switch asks for: ``DS_TENSORSHARD=1`` with the keys in ``DS_TENSORSHARD_CONFIG``."""
    raw, where = _requested_block(param_dict)
    if not isinstance(raw, Mapping):
        raise TensorShardConfigError(f"'{where}' must be a JSON object, got {type(raw).__name__}")
    try:
        return TensorShardConfig(**raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in (where, *first["loc"]))
        if first["type"] == "extra_forbidden":
            known = ", ".join(TensorShardConfig.model_fields)
            raise TensorShardConfigError(f"unknown key '{key}' (known keys: {known})") from None
        raise TensorShardConfigError(
            f"invalid value for '{key}': {first['msg']} (got {first.get('input')!r})"
        ) from None


def from_environment(param_dict: Mapping[str, Any]) -> bool:
    """Whether the plugin is on through ``DS_TENSORSHARD=1`` rather than the config's own block."""
    if BLOCK in param_dict:
        return False
    switch = os.environ.get(ENV_SWITCH, "0")
    if switch not in ("0", "1"):
        raise TensorShardConfigError(f"environment variable {ENV_SWITCH}={switch!r}: use 1 (on) or 0 (off)")
    return switch == "1"


def _requested_block(param_dict: Mapping[str, Any]) -> tuple[Any, str]:
    if not from_environment(param_dict):
        return param_dict.get(BLOCK, {}), BLOCK
    try:
        keys = json.loads(os.environ.get(ENV_CONFIG) or "{}")
    except json.JSONDecodeError as err:
        raise TensorShardConfigError(f"environment variable {ENV_CONFIG} is not valid JSON: {err}") from None
    return ({"enabled": True, **keys} if isinstance(keys, Mapping) else keys), ENV_CONFIG
