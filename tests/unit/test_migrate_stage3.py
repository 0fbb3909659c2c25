"""``migrate-config`` and ``report --config`` on stock stage-3 configs shaped as Hugging Face's ``zero3.json``
templates (with and without CPU offload, ``"auto"`` values left for the framework)."""

import copy

import pytest

from ds_tensorshard.commands.config_check import check_config
from ds_tensorshard.commands.migrate import migrate_config
from ds_tensorshard.config.stage3_checks import REFUSED_STAGE3_KEYS
from ds_tensorshard.errors import TensorShardConfigError

ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
OFFLOAD = {"device": "cpu", "pin_memory": True}


def zero3(**zero):
    config = copy.deepcopy(ZERO3)
    config["zero_optimization"].update(zero)
    return config


@pytest.mark.parametrize("offload", [{}, {"offload_optimizer": OFFLOAD, "offload_param": OFFLOAD}])
def test_hf_zero3_keeps_stage_3_and_reports_every_key(offload):
    stock = zero3(**offload)
    migrated, report = migrate_config(stock)
    assert migrated["zero_optimization"] == stock["zero_optimization"]  # stage 3 and every key kept
    assert migrated["tensorshard"] == {"enabled": True, "comm_backend": "torch"}
    for key in stock["zero_optimization"]:
        (line,) = [line for line in report if line.startswith(f"zero_optimization.{key}=")]
        assert any(word in line for word in ("honoured", "mapped")), line
    assert any("stage3_prefetch_bucket_size='auto': kept, the framework fills it; honoured" in x for x in report)
    assert any(line.startswith("zero_optimization.reduce_bucket_size='auto'") and "mapped" in line for line in report)
    if offload:
        assert any("offload_param={'device': 'cpu', 'pin_memory': True}: kept, honoured" in x for x in report)
    # report --config: the migrated config would be accepted, ds_tensorshard enabled; stock's runs as stock
    checked = check_config(migrated, world_size=2)
    assert checked["accepted"] and checked["enabled"], checked
    assert check_config(stock, world_size=2)["enabled"] is False


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_nvme_offload_is_refused_by_name(key):
    with pytest.raises(TensorShardConfigError, match=f"zero_optimization.{key}: refused"):
        migrate_config(zero3(**{key: {"device": "nvme", "nvme_path": "/local_nvme"}}))
    block = zero3(**{key: {"device": "nvme", "nvme_path": "/local_nvme"}})
    block["tensorshard"] = {"enabled": True}
    checked = check_config(block, world_size=2)
    assert not checked["accepted"] and key in checked["tensorshard"]


def test_every_refused_stage3_key_is_named():
    values = {"zero_hpz_partition_size": 8, "stage3_module_granularity_threshold": 100, "zenflow": {}}
    for key in REFUSED_STAGE3_KEYS:
        with pytest.raises(TensorShardConfigError, match=f"zero_optimization.{key}="):
            migrate_config(zero3(**{key: values.get(key, True)}))
    # at their stock defaults they stay, reported as honoured
    _, report = migrate_config(zero3(zero_quantized_weights=False, zero_hpz_partition_size=1))
    assert any(line.startswith("zero_optimization.zero_quantized_weights=False: kept, honoured") for line in report)
