"""``ds-tensorshard plan`` in process: balance, Newton-Schulz work, a Hugging Face config, 1,024 ranks."""

import json

import pytest

from ds_tensorshard.commands.cli import main as cli_main


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


def test_migrate_config_maps_the_offload_block():
    """cpu_offload (DeepSpeed's deprecated spelling) becomes offload_optimizer cpu; NVMe is dropped, saying stock
    ZeRO-1/2 has no NVMe optimizer offload; offload_param is dropped as ZeRO-3's."""
    from ds_tensorshard.commands.migrate import migrate_config

    base = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    legacy, report = migrate_config({**base, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert legacy["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert any("cpu_offload: true -> offload_optimizer" in line for line in report)
    nvme = {"stage": 1, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "cpu"}}
    migrated, report = migrate_config({**base, "zero_optimization": nvme})
    assert migrated["zero_optimization"] == {"stage": 1}
    assert any("no NVMe optimizer offload either" in line for line in report)
    assert any(line.startswith("zero_optimization.offload_param: dropped") for line in report)
