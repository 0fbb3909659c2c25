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


MIXTRAL_8X7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    num_local_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    model_type="mixtral",
)
EXPERT_NUMEL = 32 * 3 * 14336 * 4096  # one expert's w1, w2, w3 in every layer


def plan_json(capsys, *args) -> list[dict]:
    assert cli_main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_plans_mixtral_experts_over_their_expert_data_parallel_groups(tmp_path, capsys):
    """Mixtral-8x7B shapes with expert parallel 8: the dense tensors over all ranks, each rank's expert over the
    world / 8 ranks that hold it (DeepSpeed's groups: ranks e, e + 8, ...), every plan within 1.02x of ideal."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    reports = plan_json(
        capsys, "--model-config", tmp_path / "config.json", "--world-size", 8, 64, 256, "--expert-parallel", 8
    )
    for report, n in zip(reports, (8, 64, 256)):
        assert (report["world_size"], report["expert_data_parallel"], report["experts_per_rank"]) == (n, n // 8, 1)
        assert report["total_numel"] == 46_702_792_704 == report["dense"]["total_numel"] + 8 * EXPERT_NUMEL
        dense = report["dense"]
        assert dense["world_size"] == n and dense["tensors"] == 1 + 32 * 7 + 2  # embedding, 7 per layer, norm, head
        assert dense["imbalance"] <= 1.02 and dense["wire_ratio"] <= 1.02
        assert [g["experts"] for g in report["expert_groups"]] == [[e] for e in range(8)]
        for group in report["expert_groups"]:
            assert group["world_size"] == n // 8 and group["tensors"] == 96 and group["total_numel"] == EXPERT_NUMEL
            assert group["imbalance"] == 1.0 and group["split"] == {}  # 96 equal matrices over 1, 8 or 32 ranks
            assert group["numel_per_rank"] == report["expert_groups"][0]["numel_per_rank"]
        owned = report["owned_per_rank"]
        assert sum(owned) == report["total_numel"] and len(owned) == n
        assert owned[9 % n] == dense["numel_per_rank"][9 % n] + report["expert_groups"][1]["numel_per_rank"][9 % n // 8]
        assert report["owned_fullest_over_ideal"] <= 1.001
    alone = reports[0]["expert_groups"][0]  # one rank per expert-data-parallel group: nothing to send
    assert alone["sent_per_rank_max"] == 0 and alone["communication"]["tensorshard_per_owner"]["seconds"] == 0.0
    strided = reports[1]["expert_groups"][0]["communication"]["network"]  # ranks 0, 8, ...: one per 8-rank node
    assert strided["intra_node_ranks"] == 1
    assert reports[1]["dense"]["communication"]["network"]["intra_node_ranks"] == 8
    config = str(tmp_path / "config.json")
    assert cli_main(["plan", "--model-config", config, "--world-size", "64", "--expert-parallel", "8"]) == 0
    text = capsys.readouterr().out
    assert "expert 3 (ranks 3, 11, ..., 59): 96 tensors, 5,637,144,576 elements; fullest rank / ideal 1.0000" in text
    assert "tensors outside the experts, over the data-parallel group (64 ranks)" in text
    # without --expert-parallel the experts are ordinary tensors, planned over all ranks with the rest
    whole = plan_json(capsys, "--model-config", tmp_path / "config.json", "--world-size", 64)[0]
    assert whole["total_numel"] == 46_702_792_704 and whole["imbalance"] <= 1.02 and "dense" not in whole


@pytest.mark.parametrize(
    "args, message",
    [
        (("--world-size", 12, "--expert-parallel", 8), "--expert-parallel 8 does not divide --world-size 12"),
        (("--world-size", 6, "--expert-parallel", 3), "--expert-parallel 3 does not divide the model's 8 experts"),
        (("--world-size", 8, "--expert-parallel", 0), "--expert-parallel must be at least 1, got 0"),
    ],
)
def test_plan_cli_refuses_expert_parallel_sizes_that_do_not_divide(tmp_path, capsys, args, message):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    assert cli_main(["plan", "--model-config", str(tmp_path / "config.json"), *map(str, args)]) == 2
    assert message in capsys.readouterr().err


def test_plan_cli_refuses_expert_parallel_without_experts_and_bad_expert_keys(tmp_path, capsys):
    from ds_tensorshard.commands.models import hf_config_model
    from ds_tensorshard.commands.plan_report import moe_plan_report
    from ds_tensorshard.errors import ModelSourceError, PlanError

    assert cli_main(["plan", "--preset", "demo", "--world-size", "8", "--expert-parallel", "8"]) == 2
    assert "--expert-parallel 8: the model has no experts" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL_8X7B, "num_experts_per_tok": 9}))
    with pytest.raises(ModelSourceError, match="'num_experts_per_tok' 9 exceeds 'num_local_experts' 8"):
        hf_config_model(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL_8X7B, "num_local_experts": 0}))
    with pytest.raises(ModelSourceError, match="'num_local_experts' must be a positive integer"):
        hf_config_model(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    shapes, experts = hf_config_model(str(tmp_path / "config.json"))
    with pytest.raises(PlanError, match="does not divide --world-size 4"):
        moe_plan_report(shapes, experts, 4, 8, 4_000_000)
