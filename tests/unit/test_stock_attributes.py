"""The private attributes of stock ZeRO-1/2 that docs/configuration.md lists as left out (no training framework
reads them): the table stays true. Stock's optimizer has each one, with the config under which stock builds it,
and TensorShardOptimizer has none of them. In this process (one rank)."""

from __future__ import annotations

import re

import deepspeed
import pytest
import torch

from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("single_rank_world")
SECTION = "## Stock ZeRO-1/2's private attributes"
ZERO = [  # the configs under which stock builds each kind of optimizer the table names
    ({"stage": 2}, {}),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}),  # ZeRO-Offload: accumulated_grads_in_cpu
    ({"stage": 1}, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}),  # BF16_Optimizer
]


def listed() -> list[str]:
    """The names in the first column of the section's table: its code spans outside parentheses and before a
    colon (the attributes, or the class, not what the row says of them)."""
    with open(f"{ROOT}/docs/configuration.md") as f:
        section = f.read().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", row).split(":")[0])]


def names(zero: dict, extra: dict, tensorshard: bool) -> set[str]:
    """The attributes of the optimizer ``deepspeed.initialize`` builds, and its class's names."""
    config = {
        "train_batch_size": 2,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        **extra,
        **({"tensorshard": {"enabled": True}} if tensorshard else {}),
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    _, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return set(dir(optimizer)) | {cls.__name__ for cls in type(optimizer).__mro__}


def test_the_table_lists_the_attributes_deepspeeds_tests_read():
    assert set(listed()) == {
        "single_partition_of_fp32_groups",
        "averaged_gradients",
        "accumulated_grads_in_cpu",
        "nccl_start_alignment_factor",
        "parallel_partitioned_bit16_groups",
        "BF16_Optimizer",
        "fp32_groups_gradients_flat",
    }


def test_stock_has_each_listed_attribute_and_tensorshard_none():
    stock = set().union(*(names(zero, extra, tensorshard=False) for zero, extra in ZERO))
    ours = set().union(*(names(zero, extra, tensorshard=True) for zero, extra in ZERO))
    assert "DeepSpeedZeroOptimizer" in stock and "TensorShardOptimizer" in ours
    assert [name for name in listed() if name not in stock] == []
    assert [name for name in listed() if name in ours] == []
