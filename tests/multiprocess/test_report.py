"""``ds-tensorshard report`` through the command line: JSON for scripts, a stale build lock named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ds_tensorshard.commands.models import preset_shapes
from ds_tensorshard.commands.plan_report import plan_report
from tests.helpers.configs import GOOD, write
from tests.helpers.ranks import launcher_env

CLI = os.path.join(os.path.dirname(sys.executable), "ds-tensorshard")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CLI, "report", *args], capture_output=True, text=True, timeout=180, env={**launcher_env(), **(env or {})}
    )


def test_cli_names_a_stale_lock_and_how_to_remove_it(tmp_path):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (time.time() - 600, time.time() - 600))
    proc = cli(env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"remove it with `rm {lock}`" in proc.stdout
    assert "FusedAdam        not built yet" in proc.stdout
    lock.unlink()
    proc = cli(env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0 and "build locks      none" in proc.stdout, proc.stdout + proc.stderr


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
