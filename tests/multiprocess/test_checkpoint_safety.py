"""``ds-tensorshard convert-checkpoint`` refuses a crafted file whose unpickling would create a file, naming
the file and the type, for every target, and writes nothing.
"""

from __future__ import annotations

import sys

import pytest

import ds_tensorshard  # noqa: F401
from tests.helpers.one_rank import CreatesFile, plant
from tests.helpers.ranks import run_in_group

pytestmark = pytest.mark.usefixtures("single_rank_world")

RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_payload_is_refused_by_convert_checkpoint(saved, tmp_path):
    marker = tmp_path / "created_by_payload"
    plant(saved / "t" / RANK_FILE, "loss_scaler", CreatesFile(str(marker)))
    for to, dst in (("fp32", tmp_path / "w.pt"), ("zero", tmp_path / "z"), ("tensorshard", tmp_path / "ts")):
        proc = run_in_group(
            [
                sys.executable,
                "-m",
                "ds_tensorshard.commands.cli",
                "convert-checkpoint",
                str(saved),
                str(dst),
                "--to",
                to,
            ],
            timeout=300,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert RANK_FILE in proc.stderr and "refers to exec," in proc.stderr, proc.stderr
        assert not marker.exists() and not dst.exists()
