"""What a newcomer runs first, as processes: ``ds-tensorshard plan --json`` piped into a JSON reader, and pytest
without pytest-xdist."""

import json
import os
import sys

from tests.helpers import ROOT
from tests.helpers.ranks import run_cli, run_in_group


def test_plan_json_stdout_is_only_json_where_deepspeed_detects_the_accelerator():
    # without DS_ACCELERATOR DeepSpeed detects one at import and says so, through its logger, on stdout
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = run_cli("plan", "--world-size", "2", "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [report["world_size"] for report in json.loads(proc.stdout)] == [2]  # all of stdout parses
    assert "accelerator" in proc.stderr  # the detection message went to stderr


def test_pytest_runs_without_pytest_xdist():
    # tests/conftest.py's scheduler hook is optional: with xdist absent pytest does not stop at an unknown hook
    test = "tests/unit/test_errors.py"
    proc = run_in_group(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", test], cwd=ROOT
    )
    assert proc.returncode == 0 and "INTERNALERROR" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert " passed" in proc.stdout
