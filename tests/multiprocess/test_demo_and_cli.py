"""The demo example (2 real ranks) and the two-models example under the ``deepspeed`` launcher."""

import os
import re

import pytest

from tests.helpers import ROOT
from tests.helpers.ranks import run_deepspeed_launcher, run_ranks


def test_demo_trains_and_reports_state_bytes_next_to_stock_zero2():
    outputs = run_ranks(
        [
            "-m",
            "ds_tensorshard.examples.train_gpt",
            "--deepspeed_config",
            os.path.join(ROOT, "configs", "tensorshard_fp32.json"),
            "--steps",
            "8",
        ],
        2,
    )
    text = outputs[0]
    assert "train:" not in text  # no progress bar into a log (on a terminal: test_progress.py)
    start, end = map(float, re.search(r"loss: start ([\d.]+) -> end ([\d.]+) over 8 steps", text).groups())
    assert end < start
    rows = re.findall(r"rank (\d): ds_tensorshard +([\d.]+) MiB +stock ZeRO-2 +([\d.]+) MiB", text)
    assert [r[0] for r in rows] == ["0", "1"]
    ts_total = sum(float(r[1]) for r in rows)
    stock_total = sum(float(r[2]) for r in rows)
    # fp32: moments as stock, but no second fp32 copy of the weights (the model's tensors are the masters)
    assert abs(ts_total - 2 / 3 * stock_total) / stock_total < 0.01
    assert max(float(r[1]) for r in rows) <= 1.05 * ts_total / 2


@pytest.mark.extended  # the deepspeed launcher: also test_module_runner.py
def test_two_models_example_runs_under_the_deepspeed_launcher_and_prints_both_plans():
    text = run_deepspeed_launcher(["--module", "ds_tensorshard.examples.train_two_models", "--steps", "2"], 3)
    joint = re.search(r"joint plan, elements per rank: +\[([\d, ]+)\] \(fullest / ideal ([\d.]+)\)", text)
    separate = re.search(r"per-model plans, summed per rank: +\[([\d, ]+)\] \(fullest / ideal ([\d.]+)\)", text)
    assert joint and separate, text[-3000:]
    joint_loads = [int(x) for x in joint.group(1).split(",")]
    separate_loads = [int(x) for x in separate.group(1).split(",")]
    assert sum(joint_loads) == sum(separate_loads)
    assert max(joint_loads) <= max(separate_loads)  # planning the union never does worse here
    assert "step_many: median" in text and "one by one: median" in text
