"""Several models, one sharding service.

``initialize_many`` plans the union of all models' tensors at once, so per-model imbalances do not
add up on one rank, and its engines leave their last gradient reductions running into the next
model's backward; ``step_many`` steps the engines as one, each model's broadcasts running while
the next model's owned tensors are updated.

Example (every rank runs the same lines)::

    results = ds_tensorshard.initialize_many([
        dict(model=actor, model_parameters=actor.parameters(), config=actor_config),
        dict(model=critic, model_parameters=critic.parameters(), config=critic_config)])
    (actor_engine, *_), (critic_engine, *_) = results
    ...  # forward + backward on each engine
    ds_tensorshard.step_many([actor_engine, critic_engine])
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import deepspeed
import torch
from deepspeed import comm as dist

from ds_tensorshard.config.schema import parse_block
from ds_tensorshard.datapath.plan import OwnershipPlan, SplitMode, plan_ownership
from ds_tensorshard.errors import TensorShardConfigError
from ds_tensorshard.optimizer import TensorShardOptimizer

_JOINT_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> plan, during initialize


def initialize_many(items: Sequence[dict[str, Any]]) -> list[tuple]:
    """``deepspeed.initialize(**item)`` for each item, their TensorShardOptimizers sharing one plan
    balanced over the union of all the models' trainable tensors."""
    deepspeed.init_distributed()
    modes = {_split_mode(item) for item in items}
    if len(modes) > 1:
        raise TensorShardConfigError(
            f"initialize_many plans all models at once, but their configs set 'tensorshard.split_tensors' "
            f"differently ({sorted(modes)}); give them the same value"
        )
    tensors, names = [], {}
    for index, item in enumerate(items):
        if "model" not in item:
            raise TensorShardConfigError(f"initialize_many: item {index} has no 'model'")
        for name, param in item["model"].named_parameters():
            if param.requires_grad:
                key = f"{index}/{name}"
                tensors.append((key, tuple(param.shape)))
                names[id(param)] = key
    plan = plan_ownership(tensors, dist.get_world_size(), param_names=names, split=modes.pop())
    results = []
    for item in items:  # the engine hands the model's joint plan to its TensorShardOptimizer
        _JOINT_PLANS[item["model"]] = plan
        try:
            results.append(deepspeed.initialize(**item))
        finally:
            del _JOINT_PLANS[item["model"]]
    return results


def joint_plan_of(model: torch.nn.Module) -> OwnershipPlan | None:
    """The plan initialize_many made for ``model``, while its engine is being built."""
    return _JOINT_PLANS.get(model)


def _split_mode(item: Mapping[str, Any]) -> SplitMode:
    """``tensorshard.split_tensors`` of one item's config (a dict or a JSON file; or the environment switch's)."""
    config = item.get("config", item.get("config_params"))
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    return parse_block(config).split_tensors if isinstance(config, Mapping) else "auto"


def step_many(engines: Sequence[Any]) -> None:
    """``engine.step()`` for every engine, as one step: first every sharded engine at its accumulation
    boundary completes its reductions and global norm, then each model's owned tensors are updated while
    the previous model's broadcasts run; all broadcasts are complete on return. Same result as stepping
    the engines one by one."""
    sharded = [
        e.optimizer
        for e in engines
        if isinstance(e.optimizer, TensorShardOptimizer) and e.is_gradient_accumulation_boundary()
    ]
    for optimizer in sharded:
        optimizer.prepare_step(defer_broadcast=True)
    try:
        for engine in engines:
            engine.step()
    finally:
        for optimizer in sharded:
            optimizer.finish_broadcast()
