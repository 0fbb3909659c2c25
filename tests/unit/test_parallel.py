"""Parallelism that is refused (MoE, AutoTP, device-mesh sequence parallelism, a PipelineModule at stage 2 or
with fp32 accumulation), in this process, before any hook or state exists.
"""

from __future__ import annotations

import pytest
import torch


def _refused(model, config, message, mpu=None):
    import deepspeed

    import ds_tensorshard  # noqa: F401
    from ds_tensorshard.errors import TensorShardConfigError

    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "tensorshard": {"enabled": True},
        "bf16": {"enabled": True},
        **config,
    }
    with pytest.raises(TensorShardConfigError, match=message):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    # the bf16 cast of an engine that got further would have changed the weights
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # no gradient hook either


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": 2}}, "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
        (
            {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
            "'data_types.grad_accum_dtype'",
        ),
    ],
)
def test_pipeline_module_with_stage_2_or_fp32_accumulation_is_refused(config, message):
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(
        [LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss()
    )
    _refused(model, config, message)


@pytest.mark.usefixtures("single_rank_world")
def test_device_mesh_sequence_parallelism_is_refused():
    # deepspeed.initialize itself cannot build a 2-way sequence mesh on one rank: the check is called directly
    from ds_tensorshard.config import validate_parallel_layout
    from ds_tensorshard.errors import TensorShardConfigError

    config = {
        "train_batch_size": 2,
        "sequence_parallel_size": 2,
        "tensorshard": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    with pytest.raises(TensorShardConfigError, match="'sequence_parallel_size' 2"):
        validate_parallel_layout(torch.nn.Linear(4, 4), None, config)


@pytest.mark.usefixtures("single_rank_world")
def test_autotp_is_refused():
    _refused(
        torch.nn.Linear(4, 4),
        {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}},
        "'tensor_parallel.autotp_size' 2",
    )


@pytest.mark.usefixtures("single_rank_world")
def test_moe_is_refused_naming_the_first_expert_parameter():
    from deepspeed.moe.layer import MoE

    class WithExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2, ep_size=1, k=1)

        def forward(self, x):
            return self.moe(x)[0].sum()

    _refused(WithExperts(), {"zero_optimization": {"stage": 2}}, r"MoE expert parameter 'moe\.deepspeed_moe\.experts")
