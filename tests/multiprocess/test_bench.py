"""``ds-tensorshard bench`` at a tiny size: every configuration runs and the reports are written (FSDP2, whose launch
costs more than the default tier allows, trains as stock does: -m extended, with the LoRA-like model); a bench
killed mid-way leaves no process behind."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.compare import TOLERANCE
from tests.helpers.ranks import TIMEOUT_S, kill_group, launcher_env, run_in_group
from tests.helpers.terminal import on_terminal

TINY = ["--layers", "1", "--width", "32", "--vocab", "128", "--steps", "2", "--warmup", "1"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_in_group(
        [sys.executable, "-m", "ds_tensorshard.commands.cli", "bench", *args], env=launcher_env(), timeout=TIMEOUT_S
    )


NOT_FSDP2 = ["stage0", "zero1", "zero2", "ddp_zero", "ts_torch", "ts_mpi"]  # FSDP2's launch: -m extended
# CI time: stock stage 0 (the bytes an all-reduce sends), ZeRO-2 and both of ours; all of NOT_FSDP2: -m extended
COMPARED = ["stage0", "zero2", "ts_torch", "ts_mpi"]
# CI time (50 s): both behind -m extended; the bench's stop, refusals and unit tests stay in the default suite
BENCHED = [pytest.param(c, id=i, marks=pytest.mark.extended) for c, i in ((COMPARED, "compared"), (NOT_FSDP2, "all"))]


@pytest.mark.parametrize("configs", BENCHED)
def test_bench_tiny_runs_all_configurations_and_writes_reports(tmp_path, configs):
    # on a terminal, as users run it: its progress bar shows there (and in no pipe: the other bench tests)
    rc, shown = on_terminal(
        [
            sys.executable,
            "-m",
            "ds_tensorshard.commands.cli",
            "bench",
            *TINY,
            "--configs",
            *configs,
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0, shown[-3000:]
    done = f"{len(configs)}/{len(configs)}"
    assert "bench: 100%" in shown and done in shown and "ds_tensorshard (torch)" in shown, shown[-3000:]
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(results) == set(configs)
    for r in results.values():
        assert r["step_s"] > 0 and len(r["peak_rss_bytes"]) == 2 and r["sent_bytes_per_rank"] > 0
    for raw in (tmp_path / "raw").glob("*.json"):  # measured phases are real and inside the step
        config = json.loads(raw.read_text())["config"]
        for row in json.loads(raw.read_text())["steps"]:
            assert all(0.0 <= row[k] < row["step_s"] for k in ("fwd_bwd_s", "reduce_s", "optimizer_s", "gather_s"))
            assert (row["gather_s"] > 0) == (config != "stage0"), (config, row)  # stage 0 gathers nothing
            assert (row["reduce_s"] > 0) == (config != "ddp_zero"), (config, row)  # DDP reduces inside backward
    for name in ("ts_torch", "ts_mpi"):  # every tensor's state on exactly one rank
        r = results[name]
        assert r["optimizer_state_bytes_fullest"] <= 1.05 * r["optimizer_state_bytes_total"] / 2 + 8 * 4096
    # per-owner reduces and broadcasts, no padding: about what stock stage 0's all-reduce moves
    for name in ("ts_torch", "ts_mpi"):
        assert results[name]["sent_bytes_per_rank"] <= 1.02 * results["stage0"]["sent_bytes_per_rank"]
    for r in results.values():  # one more step's operators, counted: the optimizer's at least
        assert r["aten_ops_per_step"] > r["host_syncs_per_step"] >= 0, r
    assert results["zero2"]["host_syncs_per_step"] > 0  # stock ZeRO-2 reads its norm and overflow on the host
    table = (tmp_path / "results.md").read_text()
    assert "ds_tensorshard (mpi)" in table and "Step-time ratio" in table and "ATen ops/step" in table
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.extended  # CI time: several models' training against stock stays in test_many.py
def test_bench_two_models_joint_plan_fills_the_fullest_rank_least(tmp_path):
    proc = bench(*TINY, "--configs", "two_zero2", "two_ts_separate", "two_ts_joint", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bench:" not in proc.stdout + proc.stderr  # no progress bar into a pipe
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    joint, separate = results["two_ts_joint"], results["two_ts_separate"]
    assert joint["optimizer_state_bytes_total"] == separate["optimizer_state_bytes_total"]
    assert joint["optimizer_state_bytes_fullest"] < separate["optimizer_state_bytes_fullest"]
    assert joint["optimizer_state_fullest_over_ideal"] < separate["optimizer_state_fullest_over_ideal"]
    for r in results.values():  # both models of every configuration train the same way (fp32, 2 ranks)
        assert len(r["losses"]) == 2
        for loss, stock in zip(r["losses"], results["two_zero2"]["losses"]):
            assert abs(loss - stock) <= TOLERANCE["fp32"]["loss"]  # compare.py
    assert "Two GPTs" in (tmp_path / "results.md").read_text()


def test_bench_refuses_mixing_one_and_two_model_configurations(tmp_path):
    proc = bench(*TINY, "--configs", "zero2", "two_ts_joint", "--out", str(tmp_path))
    assert proc.returncode != 0 and "separate runs" in proc.stderr
    assert not (tmp_path / "raw").exists()


@pytest.mark.extended
def test_bench_muon_reports_newton_schulz_work_and_adafactor_its_state(tmp_path):
    for optimizer in ("muon", "adafactor"):
        out = tmp_path / optimizer
        proc = bench(*TINY, "--optimizer", optimizer, "--configs", "zero2", "ts_torch", "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results = {r["config"]: r for r in json.loads((out / "results.json").read_text())["results"]}
        stock, ours = results["zero2"], results["ts_torch"]
        if optimizer == "muon":  # each matrix orthogonalized once, by its owner
            assert ours["newton_schulz_fullest_over_ideal"] < stock["newton_schulz_fullest_over_ideal"]
            assert "Newton-Schulz work" in (out / "results.md").read_text()
        else:  # factored second moments instead of one value per element of a flat slice
            assert ours["optimizer_state_bytes_total"] < stock["optimizer_state_bytes_total"] / 2


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended)])
def test_bench_killed_mid_way_leaves_no_process_behind(tmp_path, signum):
    out = tmp_path / f"killed{int(signum)}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds_tensorshard.commands.cli",
            "bench",
            *TINY,
            "--steps",
            "500",
            "--configs",
            "ts_torch",
            "--out",
            str(out),
        ],
        env=launcher_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(_processes_mentioning(f"{out}/raw")) < 3:  # mpiexec and both ranks are running
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(5)  # the ranks are training
        proc.send_signal(signum)  # only the bench process itself, as a supervisor or a TTY would
        proc.wait(timeout=60)
        time.sleep(2)
        assert _processes_mentioning(f"{out}/raw") == []
    finally:
        kill_group(proc)


@pytest.mark.extended
def test_bench_fsdp2_trains_as_stock_and_sends_an_all_reduce(tmp_path):
    """PyTorch FSDP2 (ZeRO-2 form) on the same model and data: its first two losses are stock's (AdamW after step
    0), it sends an all-gather of the parameters and a reduce-scatter of the gradients (stage 0's all-reduce's
    worth), both inside forward and backward, and holds AdamW's moments of its shards only."""
    proc = bench(*TINY, "--configs", "stage0", "zero2", "fsdp2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    fsdp2, stock = results["fsdp2"], results["zero2"]
    for loss, reference in zip(fsdp2["losses_by_step"][:2], stock["losses_by_step"][:2]):
        assert abs(loss[0] - reference[0]) <= TOLERANCE["fp32"]["loss"], (loss, reference)
    assert fsdp2["sent_bytes_per_rank"] == pytest.approx(results["stage0"]["sent_bytes_per_rank"], rel=0.02)
    assert fsdp2["optimizer_state_bytes_total"] == 2 * 4 * fsdp2["numel"]
    assert fsdp2["reduce_s"] == fsdp2["gather_s"] == 0.0 < fsdp2["fwd_bwd_s"]
    assert "PyTorch FSDP2 (ZeRO-2 form)" in (tmp_path / "results.md").read_text()


@pytest.mark.extended
def test_bench_lora_model_trains_only_the_adapters_side_by_side(tmp_path):
    """``--model lora``: stock ZeRO-2, FSDP2 and ds_tensorshard train the same 40 adapter tensors on a frozen base,
    the same losses, optimizer state for the adapters only, and each step's CPU time reported."""
    lora = ["--model", "lora", "--layers", "20", "--width", "32", "--vocab", "128", "--steps", "2", "--warmup", "1"]
    proc = bench(*lora, "--configs", "zero2", "fsdp2", "ts_torch", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    adapters = 20 * 2 * 16 * 32  # two rank-16 tensors of width 32 per layer
    for r in results.values():
        assert r["numel"] == adapters and r["cpu_s"] > 0
        for loss, reference in zip(r["losses_by_step"], results["zero2"]["losses_by_step"]):
            assert abs(loss[0] - reference[0]) <= TOLERANCE["fp32"]["loss"], (r["config"], loss, reference)
    assert results["zero2"]["optimizer_state_bytes_total"] == 3 * 4 * adapters  # fp32 partition and moments
    for name in ("fsdp2", "ts_torch"):  # the moments alone: the masters are the model's own tensors
        assert results[name]["optimizer_state_bytes_total"] == 2 * 4 * adapters
    assert "LoRA-like, frozen base of 20 linear layers" in (tmp_path / "results.md").read_text()


@pytest.mark.extended
def test_bench_offload_rows_count_host_traffic(tmp_path):
    """Stock ZeRO-2 + offload and ds_tensorshard + offload: both rows, the bytes crossing to and from host memory
    per step (stock's counted from its code, ours measured), every tensor's host state on exactly one rank."""
    proc = bench(*TINY, "--configs", "zero2_offload", "ts_offload", "ts_offload_mpi", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(results) == {"zero2_offload", "ts_offload", "ts_offload_mpi"}
    assert all(r["host_bytes_per_rank"] > 0 for r in results.values())
    for ours in (results["ts_offload"], results["ts_offload_mpi"]):
        assert ours["optimizer_state_bytes_fullest"] <= 1.05 * ours["optimizer_state_bytes_total"] / 2 + 8 * 4096
    assert "ZeRO-Offload, bytes between the accelerator and host memory" in (tmp_path / "results.md").read_text()


@pytest.mark.extended
def test_bench_bf16_master_rows_report_bytes_per_parameter(tmp_path):
    """bf16.bf16_master_weights_and_grads and bf16_optimizer_states: stock ZeRO-2 keeps a bf16 master copy and bf16
    moments (6 bytes of optimizer state per parameter, against 12 with fp32 ones); ds_tensorshard's masters are the
    model's own bf16 tensors (4 bytes: the moments). Both train as stock ZeRO-2 does without the keys here."""
    configs = ("zero2", "zero2_bf16_masters", "ts_bf16_masters")
    proc = bench(*TINY, "--dtype", "bf16", "--configs", *configs, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    per_param = {name: r["optimizer_state_bytes_total"] / r["numel"] for name, r in results.items()}
    assert per_param == {"zero2": 12.0, "zero2_bf16_masters": 6.0, "ts_bf16_masters": 4.0}
    assert results["ts_bf16_masters"]["losses"] == results["zero2_bf16_masters"]["losses"]
    assert "opt. state bytes/param" in (tmp_path / "results.md").read_text()
    refused = bench(*TINY, "--configs", "ts_bf16_masters", "--out", str(tmp_path / "fp32"))
    assert refused.returncode != 0 and "bf16 master weights need --dtype bf16" in refused.stdout + refused.stderr


@pytest.mark.extended
def test_bench_stage3_rows_train_as_stock_zero3_in_alternating_rounds(tmp_path):
    """ZeRO stage 3 side by side, two alternating rounds: stock ZeRO-3, FSDP2 resharding after forward and
    ds_tensorshard's stage 3 on both transports and with offload_param train the same losses (ours bit for bit
    stock's at 2 ranks; FSDP2's AdamW the same after one step); ours hold AdamW's moments only, each tensor's on
    one rank, stock its fp32 partition too."""
    configs = ("zero3", "fsdp2_reshard", "ts3_torch", "ts3_mpi", "zero3_offload_param", "ts3_offload_param")
    wide = ["--layers", "1", "--width", "256", "--vocab", "128", "--steps", "2", "--warmup", "1"]  # some gathered
    proc = bench(*wide, "--configs", *configs, "--rounds", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(results) == set(configs)
    for name, r in results.items():
        assert len(r["step_s_by_round"]) == 2 and len(r["peak_rss_bytes"]) == 2 and r["step_s"] > 0, name
        for loss, reference in zip(r["losses_by_step"][:2], results["zero3"]["losses_by_step"]):  # FSDP2: AdamW
            assert abs(loss[0] - reference[0]) <= TOLERANCE["fp32"]["loss"], (name, loss, reference)  # after step 0
    for name in ("ts3_torch", "ts3_mpi", "ts3_offload_param"):
        assert results[name]["losses_by_step"] == results["zero3"]["losses_by_step"], name
        assert results[name]["optimizer_state_bytes_total"] == 2 * 4 * results[name]["numel"], name
        assert results[name]["optimizer_state_bytes_fullest"] <= 1.05 * results[name]["numel"] * 4 + 8 * 4096
    assert results["zero3"]["optimizer_state_bytes_total"] == 3 * 4 * results["zero3"]["numel"]
    assert len(list((tmp_path / "raw" / "round2").glob("*.json"))) == 2 * len(configs)
    table = (tmp_path / "results.md").read_text()
    assert "ds_tensorshard stage 3 (mpi)" in table and "2 alternating rounds" in table and "Step s of each" in table


def test_baseline_rows_run_the_workers_of_the_baseline_tree(tmp_path, monkeypatch):
    """``--baseline TREE``: the baseline's ranks import ds_tensorshard from TREE, also when the command runs in this
    tree (whose ``python -m`` would otherwise find its own package first): a stub worker there records its file."""
    from ds_tensorshard.bench.configs import RUN_ARGUMENTS
    from ds_tensorshard.bench.runner import run_config

    worker = tmp_path / "tree" / "ds_tensorshard" / "bench" / "worker.py"
    worker.parent.mkdir(parents=True)
    for package in (worker.parent.parent, worker.parent):
        (package / "__init__.py").write_text("")
    worker.write_text(
        "import json, os, sys\n"
        "out = os.path.join(sys.argv[2], sys.argv[1] + '.rank0.json')\n"
        "json.dump({'worker': os.path.abspath(__file__)}, open(out, 'w'))\n"
    )
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this tree
    args = argparse.Namespace(ranks=1, timeout=120, **dict.fromkeys(RUN_ARGUMENTS))
    ranks = run_config("ts_torch", args, str(tmp_path / "raw"), str(tmp_path / "tree"))
    assert ranks == [{"worker": str(worker)}]
