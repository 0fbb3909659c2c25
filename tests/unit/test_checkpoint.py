"""Checkpoint refusals in this process (one rank): a truncated, corrupt, missing or unknown-format rank file
and another model's checkpoint are refused naming the file or tensor, before any state is touched.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ds_tensorshard  # noqa: F401
from ds_tensorshard.checkpoints.files import digest_path, file_digest
from ds_tensorshard.checkpoints.rank_file import FORMAT_KEY
from ds_tensorshard.errors import CheckpointError
from tests.helpers.compare import ACROSS_WORLDS

FP32, BF16 = ACROSS_WORLDS["fp32"], ACROSS_WORLDS["bf16"]  # resumes at another world size (compare.py)


def copy_checkpoint(source, tmp_path):
    target = tmp_path / "c2"
    shutil.copytree(source, target)
    return target, target / "step3"


def assert_refused(eng, load_dir, message):
    before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    with pytest.raises(CheckpointError, match=message):
        eng.load_checkpoint(str(load_dir))
    assert all(torch.equal(before[n], p) for n, p in eng.module.named_parameters())
    assert len(eng.optimizer.optimizer.state) == 0


def test_truncated_file_is_refused_by_name(laid_out_for_two, tmp_path, engine):
    d, tag = copy_checkpoint(laid_out_for_two, tmp_path)
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(victim, victim.stat().st_size // 2)
    assert_refused(engine(), d, "zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated or corrupt")


def test_corrupt_byte_is_refused_by_name(laid_out_for_two, tmp_path, engine):
    d, tag = copy_checkpoint(laid_out_for_two, tmp_path)
    victim = tag / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert_refused(engine(), d, "mp_rank_00_model_states.pt is truncated or corrupt")


def test_missing_rank_file_is_refused(laid_out_for_two, tmp_path, engine):
    d, tag = copy_checkpoint(laid_out_for_two, tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert_refused(engine(), d, "optimizer file of rank 1 .* is missing")


def test_checkpoint_of_another_model_is_refused_naming_the_tensor(laid_out_for_two, tmp_path, engine):
    d, _ = copy_checkpoint(laid_out_for_two, tmp_path)
    assert_refused(engine(width=48), d, r"tensor '.*' has shape .* in checkpoint .* but .* in the model")
    assert_refused(engine(layers=3), d, r"checkpoint .* lacks tensor 'blocks\.2\.")
    assert_refused(engine(layers=1), d, r"checkpoint .* has tensor 'blocks\.1\..*' that the model does not train")


def test_unknown_format_version_is_refused(laid_out_for_two, tmp_path, engine):
    d, tag = copy_checkpoint(laid_out_for_two, tmp_path)
    path = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    content = torch.load(path, weights_only=False)
    content["optimizer_state_dict"][FORMAT_KEY] = 99
    torch.save(content, path)
    with open(digest_path(str(path)), "w") as f:
        f.write(file_digest(str(path)))
    assert_refused(engine(), d, "format version 99")
