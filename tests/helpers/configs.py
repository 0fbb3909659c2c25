"""A DeepSpeed config ds_tensorshard accepts, and writing a config to a file, for the report's tests."""

from __future__ import annotations

import json

GOOD = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000},
    "tensorshard": {"enabled": True, "comm_backend": "mpi", "split_tensors": "never"},
}


def write(tmp_path, config: dict, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)
