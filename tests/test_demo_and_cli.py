"""The demo example (2 real ranks) and the ``ds-tensorshard plan`` command."""

import json
import os
import re

import pytest
from ranks import run_deepspeed_launcher, run_ranks

from ds_tensorshard.commands.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.multiprocess
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
    start, end = map(float, re.search(r"loss: start ([\d.]+) -> end ([\d.]+) over 8 steps", text).groups())
    assert end < start
    rows = re.findall(r"rank (\d): ds_tensorshard +([\d.]+) MiB +stock ZeRO-2 +([\d.]+) MiB", text)
    assert [r[0] for r in rows] == ["0", "1"]
    ts_total = sum(float(r[1]) for r in rows)
    stock_total = sum(float(r[2]) for r in rows)
    # fp32: moments as stock, but no second fp32 copy of the weights (the model's tensors are the masters)
    assert abs(ts_total - 2 / 3 * stock_total) / stock_total < 0.01
    assert max(float(r[1]) for r in rows) <= 1.05 * ts_total / 2


def test_plan_cli_reports_gpt2_small_balance(capsys):
    assert cli_main(["plan", "--world-size", "2", "4", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in reports] == [2, 4]
    assert reports[0]["total_numel"] == 124_439_808  # GPT-2 small with a tied head
    assert reports[0]["imbalance"] < 1.0001 and reports[0]["split"] == {}
    four = reports[1]
    assert four["largest_tensor"]["name"] == "wte.weight"
    assert four["split"] == {"wte.weight": 2} and four["imbalance"] <= 1.02  # the embedding exceeds a share
    assert four["never_imbalance"] == pytest.approx(four["never_bound"]) == pytest.approx(38_597_376 / 31_109_952)
    assert four["largest_buffer"] == four["bucket_numel"] == 4_000_000
    assert four["wire_ratio"] <= 1.02


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3-8b"])
def test_plan_cli_scales_to_1024_ranks(capsys, preset):
    assert cli_main(["plan", "--preset", preset, "--world-size", "64", "1024", "--json"]) == 0
    for report in json.loads(capsys.readouterr().out):
        assert report["imbalance"] <= 1.02 and report["wire_ratio"] <= 1.02
        assert report["largest_buffer"] <= 4_000_000 and report["split"]
        assert report["never_imbalance"] > 1.2


def test_plan_cli_reports_newton_schulz_work_against_stocks_rule(capsys):
    assert (
        cli_main(["plan", "--preset", "llama2-7b", "--optimizer", "muon", "--world-size", "64", "1024", "--json"]) == 0
    )
    at64, at1024 = (r["newton_schulz"] for r in json.loads(capsys.readouterr().out))
    assert at64["matrices"] == 224
    assert at64["stock_work_fullest_over_ideal"] > 1.3 and at64["work_fullest_over_ideal"] < 1.06
    assert at1024["work_fullest_over_ideal"] == pytest.approx(at1024["work_bound"])  # one MLP matrix, whole
    assert at1024["stock_work_fullest_over_ideal"] > 1.9 * at1024["work_fullest_over_ideal"]
    assert at1024["stock_momentum_fullest"] == 2 * at1024["momentum_fullest"]


def test_plan_cli_reads_a_hugging_face_config(tmp_path, capsys):
    from ds_tensorshard.commands.models import LLAMA_PRESETS

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_PRESETS["llama3-8b"], "model_type": "llama"}))
    assert cli_main(["plan", "--model-config", str(tmp_path / "config.json"), "--world-size", "8", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)[0]
    assert cli_main(["plan", "--preset", "llama3-8b", "--world-size", "8", "--json"]) == 0
    assert from_file == {
        **json.loads(capsys.readouterr().out)[0],
        "plan_and_buckets_s": from_file["plan_and_buckets_s"],
    }
    assert from_file["total_numel"] == 8_030_261_248
    (tmp_path / "bad.json").write_text(json.dumps({**LLAMA_PRESETS["llama3-8b"], "intermediate_size": "big"}))
    assert cli_main(["plan", "--model-config", str(tmp_path / "bad.json"), "--world-size", "8"]) == 2
    assert "'intermediate_size' must be a positive integer" in capsys.readouterr().err


def test_plan_cli_text(capsys):
    assert cli_main(["plan", "--preset", "demo", "--layers", "2", "--world-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "world size 3" in out and out.count("  rank ") == 3 and "sent per rank per step" in out


@pytest.mark.multiprocess
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
