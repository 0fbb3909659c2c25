"""Stock ZeRO-3's ``optimizer.leaf_parameters`` (each leaf module of ``deepspeed.utils.set_z3_leaf_modules`` ->
its trained parameters, as built), which DeepSpeed's own tests read: ds_tensorshard's stage-3 optimizer has the
same map. In this process (one rank), stock's engine and ds_tensorshard's on the same model."""

from __future__ import annotations

import deepspeed
import pytest
import torch
from deepspeed.utils import set_z3_leaf_modules

pytestmark = pytest.mark.usefixtures("single_rank_world")


class WithLeaf(torch.nn.Module):
    """Two leaf candidates (``Bilinear``), one with a frozen bias, beside an ordinary Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Bilinear(4, 4, 4)
        self.plain = torch.nn.Linear(4, 4)
        self.second = torch.nn.Bilinear(4, 4, 4)
        self.second.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.plain(self.first(x, x)), x)


def leaf_map(tensorshard: bool) -> dict[str, list[str]]:
    config = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        **({"tensorshard": {"enabled": True}} if tensorshard else {}),
    }
    torch.manual_seed(0)
    model = WithLeaf()
    set_z3_leaf_modules(model, [torch.nn.Bilinear])
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert type(optimizer).__name__ == (
        "TensorShardStage3Optimizer" if tensorshard else "DeepSpeedZeroOptimizer_Stage3"
    )
    modules = {m: n for n, m in engine.module.named_modules()}
    params = {p: n for n, p in engine.module.named_parameters()}
    return {modules[m]: [params[p] for p in ps] for m, ps in optimizer.leaf_parameters.items()}


def test_leaf_parameters_are_stocks():
    stock = leaf_map(tensorshard=False)
    assert stock == {"first": ["first.weight", "first.bias"], "second": ["second.weight"]}
    assert leaf_map(tensorshard=True) == stock
