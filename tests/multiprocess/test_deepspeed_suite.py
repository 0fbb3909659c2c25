"""The DeepSpeed-suite runner's forcing (launch/deepspeed_tests.sh): a script that never imports ds_tensorshard, run
under the runner's site hook as DeepSpeed's test ranks are, gets ds_tensorshard's optimizer in the plugin run and
stock's in the stock run, and each engine is recorded (tests/helpers/deepspeed_suite/events.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import ROOT, WORKERS
from tests.helpers.deepspeed_suite.events import EVENTS, MODE, read_from
from tests.helpers.deepspeed_suite.run import SITE
from tests.helpers.ranks import free_port, run_in_group


def run(tmp_path, mode: str, *args: str) -> tuple[str, list[list[str]]]:
    events = tmp_path / f"{mode}.events"
    events.unlink(missing_ok=True)  # this run's records only
    env = {k: v for k, v in os.environ.items() if k != "DS_TENSORSHARD"}
    env.update(
        PYTHONPATH=os.pathsep.join((SITE, ROOT)),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **{MODE: mode, EVENTS: str(events)},
        **({"DS_TENSORSHARD": "1"} if mode == "plugin" else {}),
    )
    done = run_in_group([sys.executable, os.path.join(WORKERS, "suite_engine_worker.py"), *args], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, [[r["kind"], r["detail"]] for r in read_from(str(events), 0)[0]]


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.extended), 2])  # stage 1: CI time
def test_the_plugin_run_forces_ds_tensorshard_on_a_script_that_never_imports_it(tmp_path, stage):
    out, events = run(tmp_path, "plugin", str(stage))
    assert "optimizer: TensorShardOptimizer" in out
    assert events == [["zero12", "TensorShardOptimizer"], ["engaged", str(stage)]]
    out, events = run(tmp_path, "stock", str(stage))
    assert "optimizer: DeepSpeedZeroOptimizer" in out
    assert events == [["zero12", "DeepSpeedZeroOptimizer"]]


def test_a_refusal_at_initialize_is_recorded_with_its_message(tmp_path):
    out, events = run(tmp_path, "plugin", "2", "odd")
    assert "refused: RefusedAsStock: 'zero_optimization.allgather_bucket_size' 1001" in out
    assert [kind for kind, _ in events] == ["refused"] and "nccl_start_alignment_factor" in events[0][1]
    out, events = run(tmp_path, "stock", "2", "odd")  # stock's own assertion, no ds_tensorshard record
    assert "refused: AssertionError: allgather_bucket_size must be a multiple" in out and events == []


def test_a_stage_0_engine_is_not_recorded(tmp_path):
    out, events = run(tmp_path, "plugin", "0")
    assert "optimizer: " in out and events == []


@pytest.mark.extended  # CI time (22 s; the stage-1/2 plugin run stays): -m extended
def test_the_plugin_run_gives_a_stage_3_engine_and_a_zero_init_the_block(tmp_path):
    # the engine's own zero.Init (DeepSpeedZeRoOffload converting the model) is recorded as one too
    for extra in ((), ("init",)):  # ("init",): the model built under zero.Init, its config a file's path
        out, events = run(tmp_path, "plugin", "3", *extra)
        assert "optimizer: TensorShardStage3Optimizer" in out
        assert events == [["init3", ""], ["owned3", ""], ["zero3", "TensorShardStage3Optimizer"], ["engaged3", "3"]]
        out, events = run(tmp_path, "stock", "3", *extra)
        assert "optimizer: DeepSpeedZeroOptimizer_Stage3" in out
        assert events == [["init3", ""], ["zero3", "DeepSpeedZeroOptimizer_Stage3"]]
