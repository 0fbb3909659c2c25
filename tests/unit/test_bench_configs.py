"""The benchmark's configurations as DeepSpeed configs: the explicit bucket layouts beside the default one."""

import pytest

from ds_tensorshard.bench.configs import LAYOUT_CONFIGS, ds_config


@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_layout_configurations_set_the_layout_and_transport(name):
    block = ds_config(name, micro=1, dtype="fp32", bucket=None)["tensorshard"]
    transport, layout = name.split("_")[1:]
    assert block == {"enabled": True, "comm_backend": transport, "bucket_layout": layout}


def test_the_default_configurations_leave_the_layout_to_auto():
    for name in ("ts_torch", "ts_mpi"):
        assert "bucket_layout" not in ds_config(name, micro=1, dtype="fp32", bucket=None)["tensorshard"]
