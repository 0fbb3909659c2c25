"""``deepspeed.utils``' accessors on a ds_tensorshard engine in this process (one rank): an inner optimizer's own
state keys, the gradient window with a client optimizer, a parameter pickled away from its engine. The
comparisons with stock at 2 and 3 ranks are in tests/multiprocess/test_full_tensors.py."""

from __future__ import annotations

import pickle

import deepspeed
import pytest
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_optimizer_state,
)

import ds_tensorshard  # noqa: F401
from ds_tensorshard.errors import TensorAccessError, TensorShardUsageError

pytestmark = pytest.mark.usefixtures("single_rank_world")


def sgd_engine(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    config = {
        "train_batch_size": 2,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the SGD step below is checked unclipped
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "tensorshard": {"enabled": True},
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


@pytest.mark.parametrize("stage", [1, 2])
def test_a_torch_optimizers_own_state_and_the_gradient_window(stage):
    engine = sgd_engine(stage)
    weight = engine.module[0].weight
    engine.backward(engine(torch.ones(2, 4)).sum())
    grad = safe_get_full_grad(weight)  # the boundary (GAS 1): the mean gradient, before step
    assert grad is not None and grad.dtype == torch.float32 and grad.shape == weight.shape and grad.abs().sum() > 0
    before = safe_get_full_fp32_param(weight).clone()
    engine.step()
    torch.testing.assert_close(safe_get_full_fp32_param(weight), before - 0.1 * grad)  # SGD, first step
    torch.testing.assert_close(safe_get_full_optimizer_state(weight, "momentum_buffer"), grad)
    with pytest.raises(TensorAccessError, match=r"'0.weight'.*'exp_avg'.*SGD.*\['momentum_buffer'\]"):
        safe_get_full_optimizer_state(weight, "exp_avg")
    with pytest.raises(TensorAccessError, match="'0.weight'.*before engine.step"):
        safe_get_full_grad(weight)
    safe_set_full_optimizer_state(weight, torch.zeros_like(weight), "momentum_buffer")
    assert torch.equal(safe_get_full_optimizer_state(weight, "momentum_buffer"), torch.zeros_like(weight))


def test_a_parameter_pickled_away_from_its_engine_says_so():
    engine = sgd_engine(2)
    copy = pickle.loads(pickle.dumps(engine.module[0].weight))
    with pytest.raises(TensorShardUsageError, match="engine this parameter was sharded by is gone"):
        safe_get_full_fp32_param(copy)
