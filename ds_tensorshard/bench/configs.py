"""The benchmark's configurations and run options: their names, each one's DeepSpeed config, the model and batch
options shared by ``ds-tensorshard bench`` and its workers."""

from __future__ import annotations

import argparse
from typing import Any

from ds_tensorshard.commands.models import LORA_RANK

CONFIGS = ("stage0", "zero1", "zero2", "ddp_zero", "fsdp2", "ts_torch", "ts_mpi")
# two models (the second half as wide and half as deep) trained in the same processes
TWO_MODEL_CONFIGS = ("two_zero2", "two_ts_separate", "two_ts_joint")
# ZeRO-Offload (offload_optimizer cpu, pinned): stock ZeRO-2's and ds_tensorshard's (torch and mpi transports)
OFFLOAD_CONFIGS = ("zero2_offload", "ts_offload", "ts_offload_mpi")
# bf16.bf16_master_weights_and_grads and bf16_optimizer_states (stage 2, no offload; --dtype bf16 only)
MASTER_CONFIGS = ("zero2_bf16_masters", "ts_bf16_masters")
# ZeRO stage 3: stock's, FSDP2 resharding after forward, and ds_tensorshard's (parameters owned whole) on each
# transport; then both with offload_param (device cpu)
STAGE3_CONFIGS = ("zero3", "fsdp2_reshard", "ts3_torch", "ts3_mpi")
PARAM_OFFLOAD_CONFIGS = ("zero3_offload_param", "ts3_offload_param")
# ds_tensorshard with each bucket_layout set explicitly (ts_torch and ts_mpi take the default, "auto")
LAYOUT_CONFIGS = (
    "ts_torch_windows",
    "ts_torch_stripes",
    "ts_torch_flat",
    "ts_mpi_windows",
    "ts_mpi_stripes",
    "ts_mpi_flat",
)
SHARDED = (
    "ts_torch",
    "ts_mpi",
    "ts_offload",
    "ts_offload_mpi",
    "two_ts_separate",
    "two_ts_joint",
    "ts_bf16_masters",
    "ts3_torch",
    "ts3_mpi",
    "ts3_offload_param",
    *LAYOUT_CONFIGS,
)  # ds_tensorshard's
MPI_CONFIGS = ("ts_mpi", "ts_offload_mpi", "ts_mpi_windows", "ts_mpi_stripes", "ts_mpi_flat", "ts3_mpi")
ONE_MODEL_CONFIGS = CONFIGS + STAGE3_CONFIGS + PARAM_OFFLOAD_CONFIGS + OFFLOAD_CONFIGS + MASTER_CONFIGS + LAYOUT_CONFIGS


def ds_config(name: str, micro: int, dtype: str, bucket: int | None, optimizer: str = "adamw") -> dict:
    stage = {"stage0": 0, "zero1": 1}.get(name, 3 if name in STAGE3_CONFIGS + PARAM_OFFLOAD_CONFIGS else 2)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": OPTIMIZERS[optimizer],
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if bucket is not None:  # else every configuration keeps its own defaults
        config["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if name in MASTER_CONFIGS:
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    if name in OFFLOAD_CONFIGS:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if name in PARAM_OFFLOAD_CONFIGS:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if name in SHARDED:
        config["tensorshard"] = {"enabled": True, "comm_backend": "mpi" if name in MPI_CONFIGS else "torch"}
    if name in LAYOUT_CONFIGS:
        config["tensorshard"]["bucket_layout"] = name.rsplit("_", 1)[1]
    return config


RUN_ARGUMENTS = (
    "layers",
    "width",
    "vocab",
    "seq",
    "global_batch",
    "dtype",
    "steps",
    "warmup",
    "bucket_numel",
    "optimizer",
    "model",
)
OPTIMIZERS = {  # --optimizer -> the config's optimizer block
    "adamw": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "muon": {"type": "Muon", "params": {"lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01}},
    "adafactor": {"type": "Adafactor", "params": {"lr": 1e-3}},
}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, batch and timing options, shared by ``ds-tensorshard bench`` and its workers."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--bucket-numel", type=int, help="bucket size for every configuration (default: each keeps its own)"
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="inner optimizer of every DeepSpeed configuration (muon: the blocks' matrices)",
    )
    parser.add_argument(
        "--model",
        choices=["gpt", "lora"],
        default="gpt",
        help="gpt: the GPT, every tensor trained; lora: a frozen base of --layers linear layers of --width, each "
        f"with a trainable rank-{LORA_RANK} adapter (2 x --layers small tensors)",
    )


def second_model_shape(width: int, layers: int) -> dict:
    """The second model of the two-model configurations: half as wide, half as deep."""
    half = max(16, width // 2)
    return dict(width=half, layers=max(1, layers // 2), heads=max(1, half // 64))
