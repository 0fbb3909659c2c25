"""Checks that need one CUDA GPU, run by launch/gpu_check.sh (not collected by pytest).

    python -m tests.workers.gpu_check mpi OUT         two ranks on the GPU, mpi transport, vs stock ZeRO-2 on the CPU
    python -m tests.workers.gpu_check checkpoint OUT  save at step 3 and resume on CUDA vs the uninterrupted run
    python -m tests.workers.gpu_check fused OUT       DeepSpeed's FusedLamb (vs stage 0), FusedLion (vs ZeRO-2), CUDA
    python -m tests.workers.gpu_check offload OUT     ZeRO-Offload on CUDA (pinned host masters) vs stock's
    python -m tests.workers.gpu_check stripes OUT     bucket_layout "stripes" on NCCL (reduce-scatter, all-gather)
    python -m tests.workers.gpu_check bench-gpt OUT   the benchmark at one rank (NCCL): stock ZeRO-2, FSDP2, ours
    python -m tests.workers.gpu_check bench-lora OUT  the same on the LoRA-like model (2,000 adapter tensors)

Each prints a last line ``NOTE ...`` with what it measured and exits non-zero on a failure.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.helpers import ROOT, WORKERS
from tests.helpers.compare import ACROSS_WORLDS, TOLERANCE
from tests.helpers.ranks import free_port, launcher_env, run_in_group, run_ranks

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
GPU_VS_CPU = dict(loss=1e-4, param=1e-3)  # other kernels (cuBLAS vs CPU GEMM), same math


def mpiexec(args: list[str], env: dict) -> None:
    proc = run_in_group(
        [MPIEXEC, "-n", "2", sys.executable, *args],
        env={**launcher_env(), "MASTER_PORT": str(free_port()), **env},
        timeout=200,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])


def check_mpi(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    worker = os.path.join(WORKERS, "equivalence_worker.py")
    mpiexec([worker, out, "fp32:stock:2", "bf16:stock:2"], {"DS_ACCELERATOR": "cpu", "DIST_BACKEND": "gloo"})
    stock = {d: [torch.load(f"{out}/{d}_stock_2.rank{r}.pt") for r in range(2)] for d in ("fp32", "bf16")}
    mpiexec([worker, out, "fp32:tsmpi:2", "bf16:tsmpi:2"], {"DS_ACCELERATOR": "cuda", "DIST_BACKEND": "gloo"})
    worst = {}
    for dtype in ("fp32", "bf16"):
        for rank in range(2):
            ours = torch.load(f"{out}/{dtype}_tsmpi_2.rank{rank}.pt")
            loss = max(abs(a - b) for a, b in zip(ours["losses"], stock[dtype][rank]["losses"]))
            param = max((ours["params"][k] - v).abs().max().item() for k, v in stock[dtype][rank]["params"].items())
            worst[dtype] = max(worst.get(dtype, (0, 0)), (loss, param))
            limit = GPU_VS_CPU if dtype == "fp32" else TOLERANCE["bf16"]
            assert loss <= limit["loss"] and param <= (limit.get("param") or limit["atol"]), (dtype, rank, loss, param)
    from mpi4py import MPI

    cuda_aware = bool(getattr(MPI, "Query_cuda_support", lambda: False)())
    print(
        f"NOTE {'CUDA-aware MPI, direct' if cuda_aware else 'host staging (MPI not CUDA-aware)'}; "
        f"max |loss diff| fp32 {worst['fp32'][0]:.1e} bf16 {worst['bf16'][0]:.1e}"
    )


def check_checkpoint(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    worker = os.path.join(WORKERS, "checkpoint_worker.py")
    env = {"DS_ACCELERATOR": "cuda"}
    run_ranks([worker, f"{out}/ref.pt", "fp32", "ts", "2", "6", "--save", f"{out}/c", "--save-at", "3"], 1, env=env)
    run_ranks([worker, f"{out}/resumed.pt", "fp32", "ts", "2", "6", "--load", f"{out}/c"], 1, env=env)
    ref, resumed = torch.load(f"{out}/ref.pt"), torch.load(f"{out}/resumed.pt")
    diff = max(abs(resumed["losses"][s] - ref["losses"][s]) for s in resumed["losses"])
    assert sorted(resumed["losses"]) == [3, 4, 5] and diff <= ACROSS_WORLDS["fp32"]["loss"], diff
    for name, value in ref["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=ACROSS_WORLDS["fp32"]["param"])
    print(f"NOTE resumed at step 3, max |loss diff| {diff:.1e}")


def check_fused(out: str) -> None:
    from tests.helpers.compare import assert_run_matches

    os.makedirs(out, exist_ok=True)
    cases = ["fusedlamb:fp32:stock:0", "fusedlamb:fp32:ts:2", "fusedlion:fp32:stock:2", "fusedlion:fp32:ts:2"]
    run_ranks([os.path.join(WORKERS, "optim_worker.py"), out, *cases], 1, env={"DS_ACCELERATOR": "cuda"})
    load = lambda case: torch.load(f"{out}/{case.replace(':', '_')}.rank0.pt")  # noqa: E731
    lamb_reference = {k: v for k, v in load("fusedlamb:fp32:stock:0").items() if k != "norms"}
    assert_run_matches(load("fusedlamb:fp32:ts:2"), lamb_reference, "fp32", "FusedLamb vs stage 0")
    assert_run_matches(load("fusedlion:fp32:ts:2"), load("fusedlion:fp32:stock:2"), "fp32", "FusedLion vs ZeRO-2")
    print(
        f"NOTE inner optimizers {load('fusedlamb:fp32:ts:2')['inner_class']}, "
        f"{load('fusedlion:fp32:ts:2')['inner_class']}"
    )


def check_offload(out: str) -> None:
    """ZeRO-Offload on CUDA at one rank: the owned masters pinned in host memory, DeepSpeedCPUAdam on them,
    against stock ZeRO-Offload of the same config (fp32 stage 2, bf16 stage 1)."""
    from tests.helpers.compare import assert_run_matches

    os.makedirs(out, exist_ok=True)
    cases = ["fp32:stock-offload:2", "fp32:ts-offload:2", "bf16:stock-offload:1", "bf16:ts-offload:1"]
    run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), out, *cases], 1, env={"DS_ACCELERATOR": "cuda"})
    load = lambda case: torch.load(f"{out}/{case.replace(':', '_')}.rank0.pt")  # noqa: E731
    worst = 0.0
    for dtype, stage in (("fp32", 2), ("bf16", 1)):
        ours, stock = load(f"{dtype}:ts-offload:{stage}"), load(f"{dtype}:stock-offload:{stage}")
        assert ours["masters_pinned"] and ours["inner_class"] == stock["inner_class"] == "DeepSpeedCPUAdam"
        assert_run_matches(ours, stock, dtype, f"{dtype} stage {stage} offload vs stock offload")
        worst = max(worst, max((ours["params"][k] - v).abs().max().item() for k, v in stock["params"].items()))
    print(f"NOTE pinned host masters; max |param diff| vs stock offload {worst:.1e}")


def check_stripes(out: str) -> None:
    """``bucket_layout: "stripes"`` at one rank on CUDA: NCCL's ``reduce_scatter_tensor`` and
    ``all_gather_into_tensor`` move every bucket; against stock ZeRO-1/2 of the same config (fp32 stage 2, bf16
    stage 1), bit for bit (one rank: nothing is summed)."""
    os.makedirs(out, exist_ok=True)
    cases = ["fp32:stock:2", "fp32:ts-stripes:2", "bf16:stock:1", "bf16:ts-stripes:1"]
    run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), out, *cases], 1, env={"DS_ACCELERATOR": "cuda"})
    load = lambda case: torch.load(f"{out}/{case.replace(':', '_')}.rank0.pt")  # noqa: E731
    for dtype, stage in (("fp32", 2), ("bf16", 1)):
        ours, stock = load(f"{dtype}:ts-stripes:{stage}"), load(f"{dtype}:stock:{stage}")
        assert all(ours["slots"]), ours["slots"]
        assert ours["losses"] == stock["losses"], (dtype, ours["losses"], stock["losses"])
    print(f"NOTE stripes on NCCL: {len(ours['slots'])} buckets, losses equal to stock's")


def check_bench(out: str, model: str) -> None:
    """``ds-tensorshard bench`` on the GPU at one rank (NCCL): stock ZeRO-2, PyTorch FSDP2 in its ZeRO-2 form and
    ds_tensorshard (torch transport) on the GPT or the LoRA-like model; FSDP2's and ours' losses at steps 0 and 1
    against stock's, then the step times and their ratios."""
    shape = ["--model", "lora", "--layers", "1000", "--width", "128"] if model == "lora" else []
    command = [sys.executable, "-m", "ds_tensorshard.commands.cli", "bench", "--ranks", "1", *shape]
    command += ["--configs", "zero2", "fsdp2", "ts_torch", "--steps", "5", "--warmup", "2", "--out", out]
    proc = run_in_group(command, env={**launcher_env(), "DS_ACCELERATOR": "cuda"}, timeout=220)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(os.path.join(out, "results.json")) as f:
        results = {r["config"]: r for r in json.load(f)["results"]}
    stock = results["zero2"]
    for name in ("fsdp2", "ts_torch"):
        for loss, reference in zip(results[name]["losses_by_step"][:2], stock["losses_by_step"][:2]):
            assert abs(loss[0] - reference[0]) <= GPU_VS_CPU["loss"], (name, loss, reference)
    step = {name: r["step_s"] for name, r in results.items()}
    print(
        f"NOTE {model}: step s stock ZeRO-2 {step['zero2']:.4f}, FSDP2 {step['fsdp2']:.4f}, ds_tensorshard "
        f"{step['ts_torch']:.4f}; ours / FSDP2 {step['ts_torch'] / step['fsdp2']:.2f}, ours / stock "
        f"{step['ts_torch'] / step['zero2']:.2f}"
    )


if __name__ == "__main__":
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
    )  # ranks import tests
    checks = {
        "mpi": check_mpi,
        "checkpoint": check_checkpoint,
        "fused": check_fused,
        "offload": check_offload,
        "stripes": check_stripes,
        "bench-gpt": lambda out: check_bench(out, "gpt"),
        "bench-lora": lambda out: check_bench(out, "lora"),
    }
    checks[sys.argv[1]](sys.argv[2])
