"""The benchmark's configurations as DeepSpeed configs (the explicit bucket layouts beside the default one; ZeRO
stage 3, stock's and ds_tensorshard's, with and without offload_param), and alternating rounds merged into one
row per configuration."""

import argparse

import pytest

from ds_tensorshard.bench.configs import LAYOUT_CONFIGS, PARAM_OFFLOAD_CONFIGS, STAGE3_CONFIGS, ds_config
from ds_tensorshard.bench.runner import add_arguments, command_line, markdown, of_rounds
from tests.unit.test_bench_figure import fake_results


@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_layout_configurations_set_the_layout_and_transport(name):
    block = ds_config(name, micro=1, dtype="fp32", bucket=None)["tensorshard"]
    transport, layout = name.split("_")[1:]
    assert block == {"enabled": True, "comm_backend": transport, "bucket_layout": layout}


def test_the_default_configurations_leave_the_layout_to_auto():
    for name in ("ts_torch", "ts_mpi"):
        assert "bucket_layout" not in ds_config(name, micro=1, dtype="fp32", bucket=None)["tensorshard"]


STAGE3 = {  # name -> (its tensorshard block, its offload_param)
    "zero3": (None, None),
    "ts3_torch": ({"enabled": True, "comm_backend": "torch"}, None),
    "ts3_mpi": ({"enabled": True, "comm_backend": "mpi"}, None),
    "zero3_offload_param": (None, {"device": "cpu", "pin_memory": True}),
    "ts3_offload_param": ({"enabled": True, "comm_backend": "torch"}, {"device": "cpu", "pin_memory": True}),
}


@pytest.mark.parametrize("name", sorted(STAGE3))
def test_stage3_configurations_are_stage3_with_their_block_and_offload(name):
    config = ds_config(name, micro=1, dtype="fp32", bucket=None)
    block, offload = STAGE3[name]
    assert config["zero_optimization"]["stage"] == 3
    assert config.get("tensorshard") == block
    assert config["zero_optimization"].get("offload_param") == offload
    assert "offload_optimizer" not in config["zero_optimization"]
    assert set(STAGE3) | {"fsdp2_reshard"} == set(STAGE3_CONFIGS + PARAM_OFFLOAD_CONFIGS)


def test_stage3_configurations_pass_ds_tensorshard_checks():
    from ds_tensorshard.config.stage3_checks import validate_stage3

    for name in ("ts3_torch", "ts3_mpi", "ts3_offload_param"):
        config = ds_config(name, micro=1, dtype="bf16", bucket=10**6)
        validate_stage3(config, config["tensorshard"])


def test_rounds_merge_into_medians_with_each_rounds_step_and_the_highest_rss():
    rounds = [fake_results("x", s) for s in (3.0, 1.0, 2.0)]
    rounds[1]["peak_rss_bytes"] = [5, 2**31]
    merged = of_rounds(rounds)
    assert merged["step_s"] == 2.0 and merged["step_s_rounds"] == [3.0, 1.0, 2.0]
    assert merged["peak_rss_bytes"] == [2**30, 2**31] and merged["world_size"] == 2
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--configs", "zero3", "ts3_torch", "--rounds", "3"])
    assert command_line(vars(args)) == "ds-tensorshard bench --configs zero3 ts3_torch --rounds 3"
    table = markdown([merged], args)
    assert "3 alternating rounds" in table and "3.000, 1.000, 2.000" in table
