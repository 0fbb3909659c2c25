"""``python -m ds_tensorshard SCRIPT``: an unmodified script runs with the plugin, also under the deepspeed launcher."""

import glob
import json
import os
import sys

import pytest

from ds_tensorshard.__main__ import split_argv
from tests.helpers import WORKERS
from tests.helpers.ranks import TIMEOUT_S, free_port, rank_env, run_deepspeed_launcher, run_in_group, run_ranks

SCRIPT = os.path.join(WORKERS, "plain_train.py")


def results(output: str) -> list[dict]:
    return sorted(
        (json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )


def test_split_argv_hands_launcher_flags_to_the_script():
    assert split_argv(["--local_rank=1", "train.py", "--lr", "1"]) == ("train.py", ["--local_rank=1", "--lr", "1"])
    assert split_argv(["--local_rank", "0", "train.py"]) == ("train.py", ["--local_rank=0"])
    assert split_argv(["train.py", "a"]) == ("train.py", ["a"])
    with pytest.raises(SystemExit, match="usage"):
        split_argv([])
    with pytest.raises(SystemExit, match="usage"):
        split_argv(["--lr", "1"])


def test_deepspeed_launcher_with_module_flag_runs_unmodified_script():
    stdout = run_deepspeed_launcher(["--module", "ds_tensorshard", SCRIPT, "--steps", "2"], 2)
    found = results(stdout)
    assert [r["rank"] for r in found] == [0, 1]
    assert all(r["optimizer"] == "TensorShardOptimizer" for r in found)
    assert [r["local_rank"] for r in found] == [0, 1]  # --local_rank reached the script
    assert sum(found[0]["numel_per_rank"]) == 8 * 16 + 16 + 16 + 1
    # the launcher sets LOCAL_SIZE, so DeepSpeed's shm all-reduce made one segment per rank; the launch removed them
    assert [r["shm_segments"] for r in found] == [2, 2]
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{found[0]['master_port']}_*") == []


def test_plain_python_without_the_runner_gets_stock_deepspeed():
    # the same script run directly never registers the plugin: the tensorshard block is inert
    env = rank_env(0, 1, free_port())
    proc = run_in_group([sys.executable, SCRIPT, "--steps", "1"], env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [r["optimizer"] for r in results(proc.stdout)] == ["DeepSpeedZeroOptimizer"]


def test_python_m_runner_single_process():
    env = rank_env(0, 1, free_port())
    proc = run_in_group([sys.executable, "-m", "ds_tensorshard", SCRIPT, "--steps", "1"], env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [r["optimizer"] for r in results(proc.stdout)] == ["TensorShardOptimizer"]


def test_environment_switch_turns_the_plugin_on_for_a_config_built_in_code():
    env = {**rank_env(0, 1, free_port()), "DS_TENSORSHARD": "1", "DS_TENSORSHARD_CONFIG": '{"comm_backend": "mpi"}'}
    command = ["-m", "ds_tensorshard", SCRIPT, "--no-block", "--steps", "1"]
    proc = run_in_group([sys.executable, *command], env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [(r["optimizer"], r["transport"]) for r in results(proc.stdout)] == [("TensorShardOptimizer", "MpiComm")]


def test_more_ranks_than_tensors_trains_with_empty_sets():
    outputs = run_ranks(["-m", "ds_tensorshard", SCRIPT, "--one-tensor", "--steps", "3"], 3)
    found = [results(out)[0] for out in outputs]
    assert found[0]["numel_per_rank"] == [8, 0, 0]
    assert all(r["moved"] for r in found)
    assert found[0]["params_digest"] == found[1]["params_digest"] == found[2]["params_digest"]  # all got the update
