"""DeepSpeed's own tools on ds_tensorshard checkpoints (one rank, in this process): `convert-checkpoint --to zero`
writes what stock ZeRO-2 writes, ds_to_universal converts it, and stock ZeRO loads the universal checkpoint.

fp32 weights and optimizer state go through these tools by copying, so every comparison is exact.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import pytest
import torch
from deepspeed.checkpoint import ds_to_universal
from deepspeed.utils import zero_to_fp32

import ds_tensorshard  # noqa: F401
from ds_tensorshard.checkpoints.convert import convert
from ds_tensorshard.checkpoints.sources import open_checkpoint
from tests.helpers.one_rank import make_engine, train_and_save
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config, param_groups

pytestmark = pytest.mark.usefixtures("single_rank_world")

RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def saves(single_rank_world, tmp_path_factory):
    """The same model trained the same way by ds_tensorshard and by stock ZeRO-2, saved (tag ``t``)."""
    d = tmp_path_factory.mktemp("saves")
    train_and_save(make_engine("fp32", "ts", 2), d / "ts")
    train_and_save(make_engine("fp32", "stock", 2), d / "stock")
    return {"ts": d / "ts", "stock": d / "stock"}


def run_ds_to_universal(monkeypatch, *args: str) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal ARGS`` in this process (one worker: no pool)."""
    argv = ["ds_to_universal", *args, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    ds_to_universal.main(ds_to_universal.parse_arguments())


def test_to_zero_writes_what_stock_zero_writes(saves, tmp_path):
    convert(str(saves["ts"]), str(tmp_path / "zero"), "zero", world_size=1, stage=2)
    ours = torch.load(tmp_path / "zero" / "t" / RANK_FILE, weights_only=False)
    stock = torch.load(saves["stock"] / "t" / RANK_FILE, weights_only=False)
    assert list(ours) == list(stock)
    assert list(ours["optimizer_state_dict"]) == list(stock["optimizer_state_dict"])
    for key in ("param_slice_mappings", "group_paddings", "partition_count", "zero_stage", "ds_version"):
        assert ours["optimizer_state_dict"][key] == stock["optimizer_state_dict"][key], key
    ours_states = torch.load(tmp_path / "zero" / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    stock_states = torch.load(saves["stock"] / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert list(ours_states) == list(stock_states)
    assert ours_states["param_shapes"] == stock_states["param_shapes"]
    listing = sorted(os.listdir(tmp_path / "zero"))
    assert listing == ["latest", "t", "zero_to_fp32.py", "zero_to_torch.py"]  # DeepSpeed's scripts, as a stock save
    assert (tmp_path / "zero" / "zero_to_fp32.py").read_bytes() == open(zero_to_fp32.__file__, "rb").read()


def test_to_zero_feeds_ds_to_universal_and_stock_zero_loads_the_universal_checkpoint(saves, tmp_path, monkeypatch):
    # laid out for two ranks, so that ds_to_universal joins tensors split between two rank files
    convert(str(saves["ts"]), str(tmp_path / "zero"), "zero", world_size=2, stage=2)
    run_ds_to_universal(
        monkeypatch,
        "--input_folder",
        str(tmp_path / "zero" / "t"),
        "--output_folder",
        str(tmp_path / "zero" / "t_universal"),
        "--inject_missing_state",
    )
    torch.manual_seed(11)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    config = {**ds_config("fp32", "stock", 2, 1), "checkpoint": {"load_universal": True}}
    stock, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    stock.load_checkpoint(str(tmp_path / "zero"))
    assert stock.global_steps == 2
    source = open_checkpoint(str(saves["ts"] / "t"))
    for name, param in stock.module.named_parameters():
        if name not in source.shapes:
            continue
        saved = source.tensor(name)
        assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(param), saved.master), name
        assert torch.equal(param.detach(), saved.master), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(deepspeed.utils.safe_get_full_optimizer_state(param, key), saved.state[key]), (name, key)
    steps = {int(s["step"]) for s in stock.optimizer.optimizer.state.values()}
    assert steps == {source.tensor(next(iter(source.shapes))).state["step"]}
