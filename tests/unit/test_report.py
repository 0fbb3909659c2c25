"""``ds-tensorshard report`` in process (ds_tensorshard.commands.report and the modules it assembles)."""

from __future__ import annotations

import os
import sys

import deepspeed
import pytest
import torch

from ds_tensorshard.commands import config_check, extensions, report
from ds_tensorshard.commands.models import preset_shapes
from ds_tensorshard.commands.plan_report import plan_report
from ds_tensorshard.errors import TensorShardConfigError
from tests.helpers.configs import GOOD, write


def test_versions_mpi_library_and_transports_of_this_machine():
    found = report.gather()
    assert found["versions"]["torch"] == torch.__version__
    assert found["versions"]["deepspeed"] == deepspeed.__version__
    assert found["versions"]["deepspeed_unsupported"] is None
    from mpi4py import MPI

    assert found["mpi"]["library"] == " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert found["mpi"]["library"].startswith("MPICH")  # the project venv's MPI (the mpich extra)
    assert found["mpi"]["cuda_aware"] is False  # pip's MPICH is configured without CUDA
    assert found["transports"]["torch"] == "yes (gloo)"
    assert found["transports"]["mpi"].startswith("yes, launch with ")
    assert found["accelerator"]["name"] == "cpu"
    assert found["launchers"]["mpiexec"] == os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_fused_adam_is_found_where_torch_builds_it(monkeypatch, tmp_path):
    from torch.utils.cpp_extension import _get_build_directory

    # where torch builds now: TORCH_EXTENSIONS_DIR (as setup_env.sh sets it) or its default
    found = extensions.fused_adam()
    assert found["folder"] == _get_build_directory("fused_adam", False)
    # launch/setup_env.sh builds FusedAdam once before the tests, in that folder
    assert found["jit_built"] == os.path.isfile(os.path.join(found["folder"], "fused_adam.so")) == True  # noqa: E712
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    empty = extensions.fused_adam()
    assert empty["folder"] == str(tmp_path / "fused_adam") == _get_build_directory("fused_adam", False)
    assert not empty["jit_built"]


def test_build_locks_stale_when_nobody_holds_them(tmp_path):
    """As ds_tensorshard.build_locks judges them (tests/unit/test_build_locks.py): a lock that no process holds
    open is a stopped build's; a running build holds its own open."""
    stopped, busy = (tmp_path / name for name in ("fused_adam", "deepspeed_shm_comm"))
    for folder in (stopped, busy):
        folder.mkdir()
        (folder / "lock").write_text("")
    held = os.open(busy / "lock", os.O_RDONLY)  # as torch's builder holds it during the build
    try:
        locks = {lock["op"]: lock for lock in extensions.build_locks([str(tmp_path)])}
    finally:
        os.close(held)
    assert locks["fused_adam"]["stale"] and locks["fused_adam"]["fix"] == f"rm {stopped / 'lock'}"
    assert "no process holds it" in locks["fused_adam"]["why"]
    assert not locks["deepspeed_shm_comm"]["stale"] and locks["deepspeed_shm_comm"]["fix"] is None
    assert f"a build is running (process {os.getpid()} holds it)" == locks["deepspeed_shm_comm"]["why"]
    # the builder is gone now: nobody holds that lock either
    again = {lock["op"]: lock for lock in extensions.build_locks([str(tmp_path)])}
    assert again["deepspeed_shm_comm"]["stale"] and "no process holds it" in again["deepspeed_shm_comm"]["why"]


def test_config_accepted_and_its_plan_uses_the_config(tmp_path):
    shapes = preset_shapes("demo")
    found = report.gather(write(tmp_path, GOOD), [2], shapes)
    assert found["config"]["accepted"] and found["config"]["deepspeed"] == "accepted"
    assert found["config"]["comm_backend"] == "mpi"
    [plan] = found["plans"]
    assert plan == {**plan_report(shapes, 2, 50000, "never"), "plan_and_buckets_s": plan["plan_and_buckets_s"]}


def test_refusal_has_the_message_initialize_gives(tmp_path, single_rank_world):
    bad = {
        **GOOD,
        "train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "tensorshard": {"enabled": True, "bucket_size": 3},
    }
    found = config_check.check_config(bad)
    assert not found["accepted"] and found["deepspeed"] == "accepted"
    with pytest.raises(TensorShardConfigError) as raised:
        deepspeed.initialize(
            model=torch.nn.Linear(4, 4), model_parameters=torch.nn.Linear(4, 4).parameters(), config=bad
        )
    assert found["tensorshard"] == f"TensorShardConfigError: {raised.value}"
    assert "unknown key 'tensorshard.bucket_size'" in found["tensorshard"]


def test_deepspeed_refusals_and_batch_size_at_the_world_size():
    stage4 = config_check.check_config({**GOOD, "zero_optimization": {"stage": 4}})
    assert not stage4["accepted"] and "ValidationError" in stage4["deepspeed"] and stage4["tensorshard"] is None
    assert config_check.check_config(GOOD, world_size=2)["accepted"]
    unknown = config_check.check_config(GOOD)
    assert unknown["accepted"] and "give --world-size" in unknown["note"]
    at3 = config_check.check_config(GOOD, world_size=3)
    assert not at3["accepted"] and "8 != 2 * 2 * 3" in at3["deepspeed"]


def test_auto_values_are_listed_and_left_to_the_framework():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "tensorshard": {"enabled": True},
    }
    found = config_check.check_config(config)
    assert found["accepted"], found
    assert found["auto_keys"] == [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
        "zero_optimization.reduce_bucket_size",
    ]
