"""``ds-tensorshard report`` through the command line: JSON for scripts, build locks removed or named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ds_tensorshard.commands.models import preset_shapes
from ds_tensorshard.commands.plan_report import plan_report
from tests.helpers.configs import GOOD, write
from tests.helpers.ranks import launcher_env

CLI = os.path.join(os.path.dirname(sys.executable), "ds-tensorshard")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CLI, "report", *args], capture_output=True, text=True, timeout=180, env={**launcher_env(), **(env or {})}
    )


def test_cli_removes_a_stopped_builds_lock_saying_so_and_names_a_running_one(tmp_path):
    """As every ``import ds_tensorshard`` does (ds_tensorshard.build_locks): the lock a stopped build left (no
    process holds it) is removed, said on stderr, and the report finds none; a running build's stays, named."""
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")  # and closed, as the kernel closes the files of a builder that is killed
    proc = cli(env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0 and "build locks      none" in proc.stdout, proc.stdout + proc.stderr
    assert f"ds_tensorshard removed the build lock {lock} (no process holds it" in proc.stderr
    assert not lock.exists() and "FusedAdam        not built yet" in proc.stdout
    held = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDONLY)  # as torch's builder holds it during the build
    try:
        proc = cli(env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    finally:
        os.close(held)
    assert proc.returncode == 0 and lock.exists(), proc.stdout + proc.stderr
    assert f"build lock       {lock}: a build is running (process {os.getpid()} holds it)" in proc.stdout


def test_cli_json_for_scripts(tmp_path):
    path = write(tmp_path, {k: v for k, v in GOOD.items() if k != "train_batch_size"})  # fits any world size
    proc = cli("--json", "--config", path, "--world-size", "2", "4", "--preset", "demo")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found["config"]["accepted"] and [p["world_size"] for p in found["plans"]] == [2, 4]
    assert (
        found["plans"][1]["numel_per_rank"] == plan_report(preset_shapes("demo"), 4, 50000, "never")["numel_per_rank"]
    )
    assert found["mpi"]["library"].startswith("MPICH")
    refused = cli("--config", write(tmp_path, {**GOOD, "tensorshard": {"enabled": True, "comm_backend": "nccl"}}))
    assert refused.returncode == 1
    assert "REFUSED" in refused.stdout and "invalid value for 'tensorshard.comm_backend'" in refused.stdout
