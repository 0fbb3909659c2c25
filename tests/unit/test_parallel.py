"""Parallelism that is refused (AutoTP, device-mesh sequence parallelism, a PipelineModule at stage 2 or with fp32
accumulation, MoE with a pipeline, an mpu, offload or Muon), in this process, before any hook or state exists;
and a single-rank MoE checkpoint saved and loaded back.
"""

from __future__ import annotations

import os

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
    from ds_tensorshard.config.parallel_layout import validate_parallel_layout
    from ds_tensorshard.errors import TensorShardConfigError

    config = {
        "train_batch_size": 2,
        "sequence_parallel_size": 2,
        "tensorshard": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    with pytest.raises(TensorShardConfigError, match="'sequence_parallel_size' 2"):
        validate_parallel_layout(torch.nn.Linear(4, 4), None, config)


class WithExperts(torch.nn.Module):
    """A DeepSpeed MoE layer of two experts (expert parallel size 1)."""

    def __init__(self) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.moe = MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2, ep_size=1, k=1, min_capacity=2)

    def forward(self, x):
        return self.moe(x)[0].sum()


EXPERT = r"a mixture-of-experts model \(expert parameter 'moe\.deepspeed_moe\.experts\.deepspeed_experts\.0\.weight'"


@pytest.mark.usefixtures("single_rank_world")
def test_moe_in_a_pipeline_module_is_refused():
    from deepspeed.pipe import LayerSpec, PipelineModule

    model = PipelineModule([LayerSpec(WithExperts)], num_stages=1, loss_fn=torch.nn.MSELoss())
    _refused(model, {"zero_optimization": {"stage": 1}}, EXPERT.replace("moe", "0.moe", 1) + r".* in a PipelineModule")


@pytest.mark.usefixtures("single_rank_world")
def test_moe_with_an_mpu_is_refused():
    from tests.helpers.tp_model import ToyMpu

    _refused(WithExperts(), {"zero_optimization": {"stage": 2}}, EXPERT + r".* with an mpu", mpu=ToyMpu(1))


@pytest.mark.usefixtures("single_rank_world")
def test_moe_with_autotp_is_refused():
    config = {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}
    _refused(WithExperts(), config, EXPERT + r".* with 'tensor_parallel.autotp_size' 2: MoE with tensor")


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize(
    "zero,message",
    [
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "with 'zero_optimization.offload_optimizer'"),
        ({"stage": 2, "reduce_scatter": False}, "'zero_optimization.reduce_scatter' false"),  # stock asserts it
        ({"stage": 2, "contiguous_gradients": False}, "'zero_optimization.contiguous_gradients' false"),  # same
    ],
)
def test_moe_with_offload_or_what_stock_asserts_against_is_refused(zero, message):
    _refused(WithExperts(), {"zero_optimization": zero}, EXPERT + ".* " + message)


def _moe_engine(optimizer=None, initialize=None, optimizer_type="AdamW", **extra):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_tensorshard  # noqa: F401

    torch.manual_seed(0)
    model = WithExperts()
    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()), "name": "all"}])
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": optimizer_type, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorshard": {"enabled": True},
        **extra,
    }
    if optimizer is not None:
        config.pop("optimizer")
        config["zero_allow_untested_optimizer"] = True
    params = groups if optimizer is None else None
    item = dict(model=model, model_parameters=params, optimizer=optimizer and optimizer(model), config=config)
    return (initialize or (lambda item: deepspeed.initialize(**item)))(item)[0]


@pytest.mark.usefixtures("single_rank_world")
def test_moe_with_initialize_many_is_refused():
    from ds_tensorshard import initialize_many
    from ds_tensorshard.errors import TensorShardConfigError

    with pytest.raises(TensorShardConfigError, match="initialize_many with a mixture-of-experts model"):
        _moe_engine(initialize=lambda item: initialize_many([item]))


@pytest.mark.usefixtures("single_rank_world")
def test_expert_tensors_outside_a_moe_param_group_are_refused():
    from ds_tensorshard.errors import TensorShardConfigError

    with pytest.raises(
        TensorShardConfigError, match=r"'moe\.deepspeed_moe\.experts.*in a param group not marked 'moe'"
    ):
        _moe_engine(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))


@pytest.mark.usefixtures("single_rank_world")
def test_moe_with_muon_is_refused():
    """DeepSpeed's Muon runs with MoE layers under ds_tensorshard but is not checked against stock: refused."""
    from ds_tensorshard.errors import TensorShardConfigError

    with pytest.raises(
        TensorShardConfigError, match=r"the Muon optimizer \(MuonWithAuxAdam\) with a mixture-of-experts"
    ):
        _moe_engine(optimizer_type="Muon")


@pytest.mark.usefixtures("single_rank_world")
def test_moe_checkpoint_saved_at_one_rank_loads_back(tmp_path):
    """A single-rank MoE engine's save (stock's expert files, a rank file keyed by global expert index) loads
    back into a fresh engine: the same parameters and Adam moments."""
    engine = _moe_engine()
    assert sorted(engine.optimizer.domains) == ["data_parallel", "ep_size_1"]
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    files = sorted(os.listdir(tmp_path / "t"))
    assert (
        "layer_0_expert_1_mp_rank_00_model_states.pt" in files and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
    )
    saved = engine.optimizer.state_dict()["tensors"]
    torch.manual_seed(7)
    loaded = _moe_engine()
    loaded.load_checkpoint(str(tmp_path))
    for name, param in loaded.module.named_parameters():
        assert torch.equal(param, dict(engine.module.named_parameters())[name]), name
    for name, entry in loaded.optimizer.state_dict()["tensors"].items():
        assert torch.equal(entry["exp_avg_sq"], saved[name]["exp_avg_sq"]), name


@pytest.mark.usefixtures("single_rank_world")
def test_moe_universal_checkpoint_load_is_refused(tmp_path):
    from ds_tensorshard.errors import CheckpointError

    engine = _moe_engine(checkpoint={"load_universal": True})
    with pytest.raises(CheckpointError, match="universal checkpoint into a mixture-of-experts engine"):
        engine.load_checkpoint(str(tmp_path), tag="t")
