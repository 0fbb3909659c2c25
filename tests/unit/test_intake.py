"""The gradient hook (datapath/intake.py) under DeepSpeed's ``TiledMLP``: its backward runs once per shard and
marks the MLP's parameters ``ds_grad_is_ready = False`` for all but the last, as stock ZeRO then reduces only the
last shard's gradient (the shards' sum); ds_tensorshard hands each gradient on once, the sum."""

from __future__ import annotations

import copy

import pytest
import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

from ds_tensorshard.datapath.intake import GradientIntake


@pytest.mark.parametrize("held_dtype", [None, torch.float64], ids=["in_the_model", "held"])
def test_a_tiled_mlp_hands_each_gradient_on_once_summed_over_its_shards(held_dtype):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(2, 6, 8)
    reference = copy.deepcopy(mlp)
    reference(x).sum().backward()
    params = list(mlp.parameters())
    intake = GradientIntake(params, {p: str(i) for i, p in enumerate(params)}, lambda: True, held_dtype)
    handed: dict[int, list[torch.Tensor]] = {}
    intake.to_reducer = lambda p: handed.setdefault(id(p), []).append(intake.gradient_of(p).clone())

    TiledMLP.apply(lambda module, shard: module(shard), mlp, x.requires_grad_(), 3, params).sum().backward()

    assert [len(handed.get(id(p), [])) for p in params] == [1] * len(params)  # once each, after the last shard
    for param, expected in zip(params, reference.parameters()):
        (grad,) = handed[id(param)]
        assert grad.dtype == (held_dtype or torch.float32)
        torch.testing.assert_close(grad.float(), expected.grad)  # the shards' sum (in another grouping)
