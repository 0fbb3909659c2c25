"""Training frameworks that build the DeepSpeed engine themselves (``-m frameworks``): HF Transformers
``Trainer``, ``accelerate launch --use_deepspeed --deepspeed_config_file`` (a config with "auto" values) and
Lightning's ``DeepSpeedStrategy``, each on 2 CPU ranks (gloo), exact against the same framework with stock
ZeRO-2, and each resuming its own checkpoint (saved at step 3 of 6 on 2 ranks) through the framework on 3
ranks (Lightning: 4, see lightning_run), matching stock ZeRO-2 resumed through the framework on the saving 2
ranks (Lightning's own resume does not reproduce the uninterrupted run, stock or not; ``FRAMEWORKS_OUT``
records by how much). TRL's ``DPOTrainer`` with a reference model, under ``accelerate launch`` with the same
config file, matches it with stock ZeRO-2 too, its reference engine (stage 0, built by TRL) running as stock;
and a PEFT LoRA fine-tune (frozen base, adapters only) against stock ZeRO-2. The examples are
ds_tensorshard/examples/{hf_trainer,accelerate_train,lightning_train,trl_dpo,peft_lora}.py;
tests/helpers/cpu_site lifts the frameworks' "CUDA only" checks (see there; TRL has none of its own).
At ZeRO-3 each framework has a case of its own against stock ZeRO-3 (the ``stage3`` tests): HF Trainer with
``from_pretrained`` under ``zero.Init``, ``resize_token_embeddings``, gradient checkpointing, ``save_model`` and a
resume on 3 ranks; TRL DPO with its reference model as a stage-3 engine without optimizer and a generation step;
Accelerate's ``get_state_dict``; PEFT LoRA on a base built under ``zero.Init``; Lightning's strategy at stage 3.
The first run installs the ``frameworks`` extra into this venv when it is missing.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ds_tensorshard.examples.framework_common import VOCAB
from tests.helpers import ROOT
from tests.helpers.compare import ACROSS_WORLDS
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env, run_in_group, run_ranks
from tests.helpers.venvs import ensure_frameworks

pytestmark = pytest.mark.frameworks
BIN = os.path.dirname(sys.executable)
# tests/helpers/cpu_site first, and the repository (the tests package) as every test process has it
CPU_SITE = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "helpers", "cpu_site"), ROOT])}
RESUME_RANKS, RESUME_ACCUM = 3, 2  # 2 ranks x 3 accumulation = 3 ranks x 2: the same 12 samples per step
FP32_LOSS, FP32_PARAM = ACROSS_WORLDS["fp32"]["loss"], ACROSS_WORLDS["fp32"]["param"]  # compare.py
# The key bias has no true gradient (softmax ignores a shift of every score of a row): in another summation order
# its rounding noise goes through Adam into small steps of its own (Lightning resumed on 4 ranks, flat parameters:
# 1.02e-5 at one element, every other element within 6.5e-6): held to 1e-4, as compare.py's ``loose``
KEY_BIAS = 1e-4


@pytest.fixture(scope="module", autouse=True)
def frameworks_installed():
    ensure_frameworks()


def assert_same_run(ours: dict, reference: dict, where: str, steps=None) -> tuple[float, float]:
    """Same logged losses (the given steps, default all) and final parameters within fp32 tolerance;
    returns the largest loss and parameter differences."""
    steps = sorted(reference["losses"]) if steps is None else steps
    assert [s for s in steps if s in ours["losses"]] == steps, (where, ours["losses"])
    loss = max(abs(ours["losses"][s] - reference["losses"][s]) for s in steps)
    assert loss <= FP32_LOSS, f"{where}: losses {ours['losses']} vs {reference['losses']}"
    assert ours["params"].keys() == reference["params"].keys(), where
    param = 0.0
    for name, value in reference["params"].items():
        mine, close = ours["params"][name], functools.partial(torch.testing.assert_close, rtol=FP32_PARAM)
        if name.endswith("attn.c_attn.bias"):  # GPT-2's query, key, value biases: the key's held apart
            width = value.numel() // 3
            key = slice(width, 2 * width)
            close(mine[key], value[key], rtol=0.0, atol=KEY_BIAS, msg=lambda m, name=name: f"{where} {name}: {m}")
            mine, value = torch.cat([mine[:width], mine[2 * width :]]), torch.cat([value[:width], value[2 * width :]])
        close(mine, value, atol=FP32_PARAM, msg=lambda m, name=name: f"{where} {name}: {m}")
        param = max(param, float((mine - value).abs().max()))
    record(where, loss, param)
    return loss, param


def record(where: str, loss: float, param: float) -> None:
    if os.environ.get("FRAMEWORKS_OUT"):
        with open(os.environ["FRAMEWORKS_OUT"], "a") as f:
            f.write(json.dumps({"run": where, "loss": loss, "param": param}) + "\n")


STAGE2_CLASSES = ("DeepSpeedZeroOptimizer", "TensorShardOptimizer")
STAGE3_CLASSES = ("DeepSpeedZeroOptimizer_Stage3", "TensorShardStage3Optimizer")


def check_framework(name: str, run, tmp_path, resume_ranks: int = RESUME_RANKS, stage: int = 2) -> None:
    """stock ZeRO-2 (or ZeRO-3) and ds_tensorshard on 2 ranks, saving at step 3; stock resumed through the
    framework on the same 2 ranks, ds_tensorshard resumed through it on 3 ranks: the two resumed runs agree."""
    stock, ours, stock_resumed, resumed = (run(mode, tmp_path) for mode in ("stock", "ts", "stock_resume", "ts_resume"))
    stock_class, our_class = STAGE3_CLASSES if stage == 3 else STAGE2_CLASSES
    assert stock["optimizer_class"] == stock_resumed["optimizer_class"] == stock_class
    assert ours["optimizer_class"] == resumed["optimizer_class"] == our_class
    assert sorted(ours["losses"]) == list(range(1, 7))
    assert_same_run(ours, stock, f"{name}: ds_tensorshard vs stock ZeRO-{stage}, 2 ranks")
    assert {4, 5, 6} <= set(resumed["losses"]), resumed["losses"]  # (HF keeps the restored history of 1-3 too)
    assert_same_run(resumed, stock_resumed, f"{name}: resumed on {resume_ranks} ranks vs stock resumed on 2", [4, 5, 6])
    drift = max(abs(stock_resumed["losses"][s] - stock["losses"][s]) for s in (4, 5, 6))
    record(f"{name}: stock resumed vs stock uninterrupted (the framework's own resume)", drift, float("nan"))


def load(path) -> dict:
    return torch.load(path, weights_only=False)


# -- HF Trainer ------------------------------------------------------------------------------------
def hf_run(mode: str, tmp_path, stage: int = 2) -> dict:
    stock = mode.startswith("stock")
    saved, results = tmp_path / ("stock" if stock else "ts"), tmp_path / f"hf_{mode}.pt"
    args = ["-m", "ds_tensorshard.examples.hf_trainer", "--results", str(results), "--stage", str(stage)]
    args += ["--stock"] if stock else []
    ranks = 2
    if mode.endswith("resume"):
        args += ["--resume", str(saved / "checkpoint-3"), "--out", str(tmp_path / f"{mode}_out")]
        if not stock:
            args += ["--grad-accum", str(RESUME_ACCUM)]
            ranks = RESUME_RANKS
    else:
        args += ["--out", str(saved)]
    run_ranks(args, ranks, env=CPU_SITE)
    if mode == "ts":  # the Trainer's checkpoint is ds_tensorshard's: a rank file per saving rank
        names = sorted(os.listdir(saved / "checkpoint-3" / "global_step3"))
        assert [n for n in names if n.endswith("optim_states.pt")] == [
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
        assert ".zero_pp_rank_0_mp_rank_00_optim_states.pt.sha256" in names
    return load(results)


def test_hf_trainer(tmp_path):
    check_framework("HF Trainer", hf_run, tmp_path)


def test_hf_trainer_stage3_from_pretrained(tmp_path):
    """ZeRO-3 as HF users run it: the guide's ZeRO-3 config ("auto" values), ``from_pretrained`` of a saved tiny
    GPT-2 (built inside ``deepspeed.zero.Init``, loaded through ``GatheredParameters(modifier_rank=0)``),
    ``resize_token_embeddings``, gradient checkpointing; saved at step 3 and resumed on 3 ranks; the final model
    saved by ``save_model`` (``save_16bit_model``). Against stock ZeRO-3: the same losses and gathered parameters
    (within fp32 tolerance; measured bit for bit on 2 ranks), the same model files byte for byte on 2 ranks, and
    within tolerance resumed on 3 ranks against stock resumed on 2."""
    from safetensors.torch import load_file

    check_framework("HF Trainer at ZeRO-3", functools.partial(hf_run, stage=3), tmp_path, stage=3)
    for name in ("checkpoint-3/model.safetensors", "model.safetensors"):
        assert (tmp_path / "ts" / name).read_bytes() == (tmp_path / "stock" / name).read_bytes(), name
    stock, ours = (load_file(tmp_path / f"{mode}_resume_out" / "model.safetensors") for mode in ("stock", "ts"))
    assert ours.keys() == stock.keys() and "transformer.wte.weight" in ours
    assert stock["transformer.wte.weight"].shape[0] == VOCAB + 8  # resized
    for key, value in stock.items():
        torch.testing.assert_close(ours[key], value, rtol=FP32_PARAM, atol=FP32_PARAM, msg=key)


def test_hf_trainer_with_the_guides_zero2_offload_config(tmp_path):
    """The HF DeepSpeed guide's ZeRO-2 config (offload_optimizer cpu, pin_memory, "auto" values the Trainer
    fills: lr, betas, eps, weight decay, WarmupLR, batch sizes, clipping) on 2 ranks: ds_tensorshard with
    DeepSpeedCPUAdam on its owned host masters against stock ZeRO-Offload, within fp32 tolerance (compare.py);
    measured bit-identical (losses and parameters)."""
    runs = {}
    for mode in ("stock", "ts"):
        results = tmp_path / f"hf_offload_{mode}.pt"
        args = ["-m", "ds_tensorshard.examples.hf_trainer", "--offload", "--results", str(results)]
        run_ranks(args + ["--out", str(tmp_path / mode)] + (["--stock"] if mode == "stock" else []), 2, env=CPU_SITE)
        runs[mode] = load(results)
    assert runs["stock"]["optimizer_class"] == "DeepSpeedZeroOptimizer"
    assert runs["ts"]["optimizer_class"] == "TensorShardOptimizer"
    assert runs["ts"]["inner_class"] == runs["stock"]["inner_class"] == "DeepSpeedCPUAdam"
    assert sorted(runs["ts"]["losses"]) == list(range(1, 7))
    assert_same_run(runs["ts"], runs["stock"], "HF Trainer, the guide's ZeRO-2 offload config: vs stock, 2 ranks")


# -- accelerate launch -----------------------------------------------------------------------------
def accelerate_config(tmp_path, stock: bool, stage: int = 2) -> str:
    """configs/accelerate_tensorshard.json (its tensorshard block dropped for stock); at ``stage`` 3 with the
    16-bit model gathered on save, as Accelerate's ``get_state_dict`` needs it."""
    with open(os.path.join(ROOT, "configs", "accelerate_tensorshard.json")) as f:
        config = json.load(f)
    assert config["train_micro_batch_size_per_gpu"] == "auto"  # written the way Accelerate users write it
    if stock:
        config.pop("tensorshard")
    if stage == 3:
        config["zero_optimization"].update(stage=3, stage3_gather_16bit_weights_on_model_save=True)
    path = tmp_path / f"accelerate_{'stock' if stock else 'ts'}_{stage}.json"
    path.write_text(json.dumps(config))
    return str(path)


def accelerate_run(mode: str, tmp_path, stage: int = 2) -> dict:
    stock = mode.startswith("stock")
    results = tmp_path / f"acc_{mode}.pt"
    ranks, accum = (RESUME_RANKS, RESUME_ACCUM) if mode == "ts_resume" else (2, 3)
    cmd = [
        os.path.join(BIN, "accelerate"),
        "launch",
        "--use_deepspeed",
        "--deepspeed_config_file",
        accelerate_config(tmp_path, stock, stage),
        "--num_processes",
        str(ranks),
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "-m",
        "ds_tensorshard.examples.accelerate_train",
        "--out",
        str(tmp_path / ("stock" if stock else "ts")),
        "--grad-accum",
        str(accum),
        "--results",
        str(results),
    ]
    if mode.endswith("resume"):
        cmd += ["--resume", str(tmp_path / ("stock" if stock else "ts") / "step_3")]
    if stage == 3:
        cmd += ["--state-dict", str(tmp_path / f"acc_{mode}_state.pt")]
    proc = subprocess.run(
        cmd, env={**launcher_env(), **CPU_SITE}, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return load(results)


def test_accelerate_launch_with_auto_config(tmp_path):
    check_framework("accelerate launch", accelerate_run, tmp_path)


def test_accelerate_stage3_get_state_dict(tmp_path):
    """The same at ZeRO-3 (the config file's stage 3, ``stage3_gather_16bit_weights_on_model_save``), and
    ``accelerator.get_state_dict(model)`` after training: the same tensors as stock ZeRO-3's, byte for byte on 2
    ranks, within fp32 tolerance resumed on 3 ranks against stock resumed on 2."""
    check_framework("accelerate launch at ZeRO-3", functools.partial(accelerate_run, stage=3), tmp_path, stage=3)
    states = {mode: load(tmp_path / f"acc_{mode}_state.pt") for mode in ("stock", "ts", "stock_resume", "ts_resume")}
    assert states["ts"].keys() == states["stock"].keys() and "lm_head.weight" in states["ts"]
    for key, value in states["stock"].items():
        assert torch.equal(states["ts"][key], value), key
        torch.testing.assert_close(
            states["ts_resume"][key], states["stock_resume"][key], rtol=FP32_PARAM, atol=FP32_PARAM
        )


# -- Lightning -------------------------------------------------------------------------------------
def lightning_run(mode: str, tmp_path, stage: int = 2) -> dict:
    stock = mode.startswith("stock")
    results = tmp_path / f"pl_{mode}.pt"
    # Lightning restores its loop's batch progress: a resume reproduces stock only with the same batches per
    # rank per epoch and the same accumulation, so the other world size is 4 ranks of micro batch 1 (not 3 x 2)
    devices, micro = (4, 1) if mode == "ts_resume" else (2, 2)
    saved = tmp_path / ("stock" if stock else "ts")
    cmd = [
        sys.executable,
        "-m",
        "ds_tensorshard.examples.lightning_train",
        "--devices",
        str(devices),
        "--micro-batch",
        str(micro),
        "--grad-accum",
        "3",
        "--results",
        str(results),
    ] + (["--stock"] if stock else [])
    cmd += ["--stage", str(stage)]
    if mode.endswith("resume"):
        cmd += ["--resume", str(saved / "step3.ckpt"), "--out", str(tmp_path / f"{mode}_out")]
    else:
        cmd += ["--out", str(saved)]
    env = {**launcher_env(), **CPU_SITE, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return load(results)


def test_lightning_deepspeed_strategy(tmp_path):
    check_framework("Lightning DeepSpeedStrategy", lightning_run, tmp_path, resume_ranks=4)


def test_lightning_deepspeed_strategy_stage3(tmp_path):
    """``DeepSpeedStrategy(stage=3)`` (its config at stage 3): as stock ZeRO-3 on 2 ranks."""
    stock, ours = (lightning_run(mode, tmp_path, stage=3) for mode in ("stock", "ts"))
    assert (stock["optimizer_class"], ours["optimizer_class"]) == STAGE3_CLASSES
    assert sorted(ours["losses"]) == list(range(1, 7))
    assert_same_run(ours, stock, "Lightning DeepSpeedStrategy at ZeRO-3: ds_tensorshard vs stock ZeRO-3, 2 ranks")


def test_lightning_deepspeed_strategy_stage3_resume(tmp_path):
    """Resumed through Lightning from its step-3 checkpoint on 4 ranks, as stock ZeRO-3 resumed on 2. Resumed from
    a checkpoint saved at an epoch's end, Lightning runs one more batch of the old epoch and calls the optimizer's
    ``zero_grad()`` between two micro-steps of the next step: stock's stage 3 then replaces what it accumulated with
    the next backward's gradients, and so does ds_tensorshard's (before it did not: 3.5e-2 apart on the loss of
    steps 4-6)."""
    run = functools.partial(lightning_run, stage=3)
    check_framework("Lightning DeepSpeedStrategy at ZeRO-3", run, tmp_path, resume_ranks=4, stage=3)


# -- TRL DPOTrainer ---------------------------------------------------------------------------------
AS_STOCK = "'zero_optimization.stage' 0: no ZeRO-1/2 optimizer to replace, this engine runs as stock DeepSpeed"


def dpo_run(stock: bool, tmp_path, stage: int = 2) -> tuple[dict, str]:
    """ds_tensorshard.examples.trl_dpo through ``accelerate launch`` on 2 ranks with the Accelerate config file
    (its tensorshard block dropped for stock; at stage 3 ending with a generation step); its results and the
    launch's whole output."""
    results = tmp_path / f"dpo_{'stock' if stock else 'ts'}_{stage}.pt"
    cmd = [
        os.path.join(BIN, "accelerate"),
        "launch",
        "--use_deepspeed",
        "--deepspeed_config_file",
        accelerate_config(tmp_path, stock, stage),
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "-m",
        "ds_tensorshard.examples.trl_dpo",
        "--out",
        str(tmp_path / "dpo_out"),
        "--results",
        str(results),
    ] + (["--generate"] if stage == 3 else [])
    env = {**launcher_env(), **CPU_SITE, "HF_HUB_OFFLINE": "1"}
    proc = run_in_group(cmd, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return load(results), proc.stdout + proc.stderr


def test_trl_dpo_with_reference_model(tmp_path):
    """DPOTrainer with a reference model: the policy's engine is ds_tensorshard's and matches stock ZeRO-2; the
    reference's, which TRL builds from the same config at stage 0 without an optimizer, runs as stock (and says
    so once, on rank 0), frozen."""
    stock, stock_output = dpo_run(True, tmp_path)
    ours, output = dpo_run(False, tmp_path)
    assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer"
    assert ours["optimizer_class"] == "TensorShardOptimizer"
    for run in (stock, ours):
        assert (run["ref_optimizer_class"], run["ref_zero_stage"], run["ref_unchanged"]) == ("NoneType", 0, True)
    assert output.count(AS_STOCK) == 1, output[-4000:]
    assert AS_STOCK not in stock_output
    assert sorted(ours["losses"]) == list(range(1, 9))
    # the policy starts as the reference, so the first step's DPO loss is -log(sigmoid(0)) = log 2
    assert abs(ours["losses"][1] - math.log(2)) < 1e-6, ours["losses"]
    assert_same_run(ours, stock, "TRL DPOTrainer: ds_tensorshard vs stock ZeRO-2, 2 ranks")
    margin = max(abs(ours["margins"][s] - stock["margins"][s]) for s in stock["margins"])
    assert margin <= FP32_LOSS, (ours["margins"], stock["margins"])
    record("TRL DPOTrainer: rewards/margins, ds_tensorshard vs stock ZeRO-2", margin, float("nan"))


def test_trl_dpo_stage3_with_reference_model_and_generation(tmp_path):
    """DPOTrainer at ZeRO-3: the policy's engine is ds_tensorshard's stage 3 and matches stock ZeRO-3 (within fp32
    tolerance; measured bit for bit); the reference's, which TRL builds at stage 3 without an optimizer, is stock's
    ``DeepSpeedZeRoOffload`` alone in both runs, frozen. Then a generation step as GRPO takes it
    (``unwrap_model_for_generation``: gathered parameters, the hooks removed and put back): the same tokens, and the
    same loss from the policy's engine afterwards."""
    stock, _ = dpo_run(True, tmp_path, stage=3)
    ours, _ = dpo_run(False, tmp_path, stage=3)
    assert (stock["optimizer_class"], ours["optimizer_class"]) == STAGE3_CLASSES
    for run in (stock, ours):
        assert (run["ref_optimizer_class"], run["ref_zero_stage"], run["ref_unchanged"]) == (
            "DeepSpeedZeRoOffload",
            3,
            True,
        )
    assert sorted(ours["losses"]) == list(range(1, 9))
    assert_same_run(ours, stock, "TRL DPOTrainer at ZeRO-3: ds_tensorshard vs stock ZeRO-3, 2 ranks")
    margin = max(abs(ours["margins"][s] - stock["margins"][s]) for s in stock["margins"])
    assert margin <= FP32_LOSS, (ours["margins"], stock["margins"])
    assert torch.equal(ours["generated"], stock["generated"]) and ours["generated"].shape[1] > 4
    after = abs(ours["loss_after_generation"] - stock["loss_after_generation"])
    assert after <= FP32_LOSS, (ours["loss_after_generation"], stock["loss_after_generation"])
    record("TRL DPOTrainer at ZeRO-3: loss after the generation step", after, float("nan"))


def test_lightning_refuses_cpu_without_the_test_bypass(tmp_path):
    """What a user sees on a CPU-only machine: Lightning's own refusal (the path runs on CUDA GPUs)."""
    cmd = [sys.executable, "-m", "ds_tensorshard.examples.lightning_train", "--devices", "1", "--out", str(tmp_path)]
    env = {**launcher_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode != 0 and "only supported on CUDA GPUs" in proc.stdout + proc.stderr


# -- PEFT LoRA -------------------------------------------------------------------------------------
def peft_run(stock: bool, checkpointing: str, tmp_path, stage: int = 2) -> dict:
    results = tmp_path / f"peft_{'stock' if stock else 'ts'}_{stage}.pt"
    args = ["-m", "ds_tensorshard.examples.peft_lora", "--checkpointing", checkpointing, "--results", str(results)]
    run_ranks(args + ["--stage", str(stage)] + (["--stock"] if stock else []), 2)
    return load(results)


@pytest.mark.parametrize("checkpointing", ["none", "non_reentrant", "reentrant"])
def test_peft_lora_adapters_only(tmp_path, checkpointing):
    """LoRA on every projection of a GPT-2 whose own weights are frozen (with Transformers' activation
    checkpointing too): the same losses and adapters as stock ZeRO-2 on 2 ranks, the base weights untouched."""
    from ds_tensorshard.examples.peft_lora import lora_model

    stock, ours = peft_run(True, checkpointing, tmp_path), peft_run(False, checkpointing, tmp_path)
    assert (stock["optimizer_class"], ours["optimizer_class"]) == ("DeepSpeedZeroOptimizer", "TensorShardOptimizer")
    assert sorted(ours["losses"]) == list(range(1, 7))
    assert_same_run(ours, stock, f"PEFT LoRA (checkpointing {checkpointing}): ds_tensorshard vs stock ZeRO-2, 2 ranks")
    initial = {n: p.detach() for n, p in lora_model("none").named_parameters()}
    assert initial.keys() == ours["params"].keys()
    for name, value in initial.items():
        if ".lora_" not in name:
            assert torch.equal(ours["params"][name], value), f"frozen {name} changed"
        elif ".lora_B." in name:  # zero at the start: trained
            assert ours["params"][name].abs().max() > 0, name


@pytest.mark.parametrize("checkpointing", ["none", "non_reentrant"])
def test_peft_lora_stage3(tmp_path, checkpointing):
    """LoRA at ZeRO-3 on a base built inside ``deepspeed.zero.Init`` (PEFT wraps layers whose weights are kept by
    their owners, reading ``ds_shape``): the same parameters as stock ZeRO-3 after initialize, the same losses and
    final parameters (within fp32 tolerance; measured bit for bit) on 2 ranks, the frozen base untouched."""
    stock, ours = peft_run(True, checkpointing, tmp_path, 3), peft_run(False, checkpointing, tmp_path, 3)
    assert (stock["optimizer_class"], ours["optimizer_class"]) == STAGE3_CLASSES
    assert sorted(ours["losses"]) == list(range(1, 7))
    assert_same_run(ours, stock, f"PEFT LoRA at ZeRO-3 (checkpointing {checkpointing}): vs stock ZeRO-3, 2 ranks")
    assert ours["initial"].keys() == ours["params"].keys()
    for name, value in ours["initial"].items():  # gathered after initialize, as stock's
        assert torch.equal(value, stock["initial"][name]), name
        if ".lora_" not in name:
            assert torch.equal(ours["params"][name], value), f"frozen {name} changed"
        elif ".lora_B." in name:  # zero at the start: trained
            assert ours["params"][name].abs().max() > 0, name
