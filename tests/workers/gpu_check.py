"""The checks of launch/gpu_check.sh on a machine with one NVIDIA GPU (not collected by pytest):

    python -m tests.workers.gpu_check OUT [CHECK ...]      (every check when none is named)

Each runs ds_tensorshard and stock ZeRO-1/2 on the same GPU (NCCL at world size 1; two ranks where one GPU allows
it: the mpi transport over a gloo group) and compares them. A check that fails, raises or cannot run is a FAIL:
nothing is skipped. At the end one table: each check, its outcome and its figure; the exit status is the number
of checks that did not pass. ``GPU_CHECK_EMULATED=1`` runs the same on emulated CUDA (tests/helpers/
emulated_cuda.py), to try the script where there is no GPU: the step check then uses a small GPT and has no
profiler figure.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch

from tests.helpers import ROOT, WORKERS
from tests.helpers.compare import ACROSS_WORLDS, TOLERANCE, assert_run_matches
from tests.helpers.ranks import free_port, launcher_env, run_in_group, run_ranks

EMULATED = os.environ.get("GPU_CHECK_EMULATED") == "1"
ON_GPU = {"EMULATED_CUDA": "1"} if EMULATED else {"DS_ACCELERATOR": "cuda"}
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
GPU_VS_CPU = dict(loss=1e-4, param=1e-3)  # other kernels (cuBLAS vs CPU GEMM), the same arithmetic
MiB = 2**20


def loader(out: str) -> Callable[[str, int], dict]:
    return lambda case, rank=0: torch.load(f"{out}/{case.replace(':', '_')}.rank{rank}.pt")


def largest(ours: dict, reference: dict) -> tuple[float, float]:
    loss = max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"]))
    return loss, max((ours["params"][k].cpu() - v.cpu()).abs().max().item() for k, v in reference["params"].items())


def against_stock(out: str, worker: str, pairs: list[tuple[str, str]], dtype_of: Callable[[str], str]) -> str:
    """Run every case of ``pairs`` (ours, stock's) at world size 1 and compare: the largest differences. A stage-0
    reference records 0 for every gradient norm (that engine computes none here): norms are then left out, as
    the project's Muon tests leave them."""
    cases = [case for pair in pairs for case in pair]
    run_ranks([os.path.join(WORKERS, worker), out, *cases], 1, env=ON_GPU)
    load, worst = loader(out), (0.0, 0.0)
    for ours, stock in pairs:
        reference = load(stock)
        if stock.endswith(":0"):
            reference = {k: v for k, v in reference.items() if k != "norms"}
        assert_run_matches(load(ours), reference, dtype_of(ours), f"{ours} vs {stock}")
        worst = max(worst, largest(load(ours), load(stock)))
    return f"max loss diff {worst[0]:.1e}, param diff {worst[1]:.1e}"


def check_equivalence(out: str) -> str:
    """fp32 and bf16, stages 1 and 2, GAS 2, clipping 1.0, windows and stripes, against stock ZeRO-1/2."""
    pairs = [(f"{d}:ts:{s}", f"{d}:stock:{s}") for d in ("fp32", "bf16") for s in (1, 2)]
    pairs += [("fp32:ts-stripes:2", "fp32:stock:2"), ("bf16:ts-stripes:1", "bf16:stock:1")]
    return against_stock(out, "equivalence_worker.py", pairs, lambda case: case.split(":")[0])


def check_offload(out: str) -> str:
    """ZeRO-Offload with pinned host memory (clipping on), against stock ZeRO-Offload."""
    pairs = [("fp32:ts-offload:2", "fp32:stock-offload:2"), ("bf16:ts-offload:1", "bf16:stock-offload:1")]
    figure = against_stock(out, "equivalence_worker.py", pairs, lambda case: case.split(":")[0])
    assert all(loader(out)(ours)["masters_pinned"] for ours, _ in pairs), "offloaded masters not in pinned memory"
    return f"pinned masters; {figure}"


def check_muon(out: str) -> str:
    """DeepSpeed's Muon at stage 2, and with ZeRO-Offload, against the unsharded run (stage 0); fp32 (the
    Newton-Schulz iterations run in the accelerator's half precision in both)."""
    pairs = [("muon:fp32:ts:2", "muon:fp32:stock:0"), ("muon:fp32:ts-offload:2", "muon:fp32:stock:0")]
    return against_stock(out, "optim_worker.py", pairs, lambda case: case.split(":")[1])


def check_compile(out: str) -> str:
    """``engine.compile()`` (inductor) at stage 2, against stock compiled the same way."""
    pairs = [("compile_inductor_stage2:ts", "compile_inductor_stage2:stock")]
    figure = against_stock(out, "feature_worker.py", pairs, lambda case: "fp32")
    assert loader(out)(pairs[0][0])["compiled"], "the engine was not compiled"
    return figure


def check_checkpoint(out: str) -> str:
    """Saved at step 3, resumed: the uninterrupted run's losses and parameters."""
    worker = os.path.join(WORKERS, "checkpoint_worker.py")
    run_ranks([worker, f"{out}/ref.pt", "fp32", "ts", "2", "6", "--save", f"{out}/c", "--save-at", "3"], 1, env=ON_GPU)
    run_ranks([worker, f"{out}/resumed.pt", "fp32", "ts", "2", "6", "--load", f"{out}/c"], 1, env=ON_GPU)
    ref, resumed = torch.load(f"{out}/ref.pt"), torch.load(f"{out}/resumed.pt")
    diff = max(abs(resumed["losses"][s] - ref["losses"][s]) for s in resumed["losses"])
    assert sorted(resumed["losses"]) == [3, 4, 5] and diff <= ACROSS_WORLDS["fp32"]["loss"], diff
    for name, value in ref["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=ACROSS_WORLDS["fp32"]["param"])
    return f"resumed at step 3, max loss diff {diff:.1e}"


def check_stage3(out: str) -> str:
    """ZeRO stage 3 with owned parameters against stock ZeRO-3 (fp32 at both persistence thresholds, checkpointed
    blocks, bf16; tests/workers/stage3_worker.py), then the step of a bf16 GPT: seconds, peak memory, ATen
    operators and host syncs of ``engine.step()`` against stock ZeRO-3's; with ``offload_param`` its peak device
    memory at most stock's."""
    variants = [("fp32", ""), ("fp32", "persist0"), ("fp32", "ckpt"), ("bf16", "persist0")]
    name = lambda d, m, v: f"{d}:{m}:{v}" if v else f"{d}:{m}"  # noqa: E731
    pairs = [(name(d, "ts", v), name(d, "stock", v)) for d, v in variants]
    figure = against_stock(out, "stage3_worker.py", pairs, lambda case: case.split(":")[0])
    env = {**ON_GPU, "PROBE_STAGE": "3", **({"PROBE_WIDTH": "256", "PROBE_LAYERS": "2"} if EMULATED else {})}
    ours, stock = probe("step", out, "ts", env), probe("step", out, "stock", env)
    assert ours["host_syncs_per_step"] <= stock["host_syncs_per_step"], (ours, stock)
    # offload_param (issue 47): the owners' tensors in host memory, on the device only inside a gather
    off = {**env, "PROBE_OFFLOAD_PARAM": "1"}
    ours_off, stock_off = (
        probe("step", out, "ts", off, "offload_param"),
        probe("step", out, "stock", off, "offload_param"),
    )
    assert ours_off["peak_bytes"] <= stock_off["peak_bytes"], (ours_off["peak_bytes"], stock_off["peak_bytes"])
    return (
        f"{figure}; offload_param peak {ours_off['peak_bytes'] / stock_off['peak_bytes']:.2f}x "
        f"({ours_off['peak_bytes'] / 2**30:.2f} GiB vs {stock_off['peak_bytes'] / 2**30:.2f}); "
        f"{ours['params'] / 1e9:.2f}B step {ours['step_s'] * 1e3:.1f} ms vs stock "
        f"{stock['step_s'] * 1e3:.1f} ({ours['step_s'] / stock['step_s']:.2f}x), peak "
        f"{ours['peak_bytes'] / stock['peak_bytes']:.2f}x; step ops {ours['aten_ops_per_step']} vs "
        f"{stock['aten_ops_per_step']}, host syncs {ours['host_syncs_per_step']} vs {stock['host_syncs_per_step']}"
    )


def probe(check: str, out: str, mode: str, env: dict | None = None, tag: str = "") -> dict:
    """One rank of probe_worker.py's ``check`` in ``mode``; ``tag`` names a second run of the same check apart."""
    path = f"{out}/{check}_{mode}{'_' + tag if tag else ''}"
    run_ranks([os.path.join(WORKERS, "probe_worker.py"), check, path, mode], 1, env=env or ON_GPU)
    with open(f"{path}.rank0.json") as f:
        return json.load(f)


def check_offload_states(out: str) -> str:
    """``engine.offload_states()``: the device memory reserved before and after, ours against stock's."""
    ours, stock = probe("offload-states", out, "ts"), probe("offload-states", out, "stock")
    assert ours["losses"] == stock["losses"], (ours["losses"], stock["losses"])
    (_, before), (_, after) = ours["before"], ours["after"]
    assert after <= max(stock["after"][1], 0.05 * before), (
        f"reserved after offload: ours {after}, stock {stock['after']}"
    )
    return (
        f"reserved MiB before -> after: ours {before / MiB:.1f} -> {after / MiB:.1f}, "
        f"stock {stock['before'][1] / MiB:.1f} -> {stock['after'][1] / MiB:.1f}"
    )


def check_mpi(out: str) -> str:
    """Two ranks on the one GPU (the mpi transport; torch.distributed over gloo, since NCCL takes one rank per
    device): against stock ZeRO-2 on the CPU. CUDA tensors go to MPI directly or staged in pinned memory."""
    if not os.path.exists(MPIEXEC):
        raise AssertionError(f"no mpiexec beside {sys.executable}: install mpich (launch/gpu_check.sh carries it)")
    worker, cases = os.path.join(WORKERS, "equivalence_worker.py"), ["fp32:tsmpi:2", "bf16:tsmpi:1"]
    stock_cases = [case.replace("tsmpi", "stock") for case in cases]
    rank = "RANK=${PMI_RANK:-$OMPI_COMM_WORLD_RANK} LOCAL_RANK=0 WORLD_SIZE=2"  # both ranks on device 0
    for env, run_cases in (({"DS_ACCELERATOR": "cpu"}, stock_cases), ({**ON_GPU, "DIST_BACKEND": "gloo"}, cases)):
        script = f"{rank} exec {sys.executable} {worker} {out} {' '.join(run_cases)}"
        port = str(free_port())
        environment = {**launcher_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **env}
        proc = run_in_group([MPIEXEC, "-n", "2", "sh", "-c", script], env=environment, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    load, worst = loader(out), (0.0, 0.0)
    for case, stock_case in zip(cases, stock_cases):
        for r in range(2):
            ours, stock = load(case, r), load(stock_case, r)
            tol = GPU_VS_CPU if case.startswith("fp32") else {"loss": TOLERANCE["bf16"]["loss"], "param": 1e-2}
            loss, param = largest(ours, stock)
            assert loss <= tol["loss"] and param <= tol["param"], (case, r, loss, param)
            worst = max(worst, (loss, param))
    return f"against stock ZeRO-2 on the CPU: max loss diff {worst[0]:.1e}, param diff {worst[1]:.1e}"


def check_step(out: str) -> str:
    """A bf16 GPT of about 1B parameters at world size 1: step time, peak memory, operators and host syncs of
    ``engine.step()`` against stock ZeRO-2's, and the longest idle gap of the GPU during backward."""
    env = {**ON_GPU, **({"PROBE_WIDTH": "256", "PROBE_LAYERS": "2"} if EMULATED else {})}
    ours, stock = probe("step", out, "ts", env), probe("step", out, "stock", env)
    assert ours["host_syncs_per_step"] <= stock["host_syncs_per_step"], (ours, stock)
    assert ours["aten_ops_per_step"] <= stock["aten_ops_per_step"], (ours, stock)
    gap = ours["longest_gap_in_backward_s"]
    assert gap is not None or EMULATED, "no kernel timeline (torch.profiler saw no CUDA activity)"
    return (
        f"{ours['params'] / 1e9:.2f}B: step {ours['step_s'] * 1e3:.1f} ms vs stock {stock['step_s'] * 1e3:.1f} "
        f"({ours['step_s'] / stock['step_s']:.2f}x), peak {ours['peak_bytes'] / stock['peak_bytes']:.2f}x; "
        f"step ops {ours['aten_ops_per_step']} vs {stock['aten_ops_per_step']}, host syncs "
        f"{ours['host_syncs_per_step']} vs {stock['host_syncs_per_step']}; longest gap in backward "
        + (
            "n/a (emulated)"
            if gap is None
            else f"{gap * 1e3:.2f} ms (stock {stock['longest_gap_in_backward_s'] * 1e3:.2f})"
        )
    )


def check_lora(out: str) -> str:
    """The LoRA-like model (1,000 adapted layers, 2,000 trained tensors, fp32) at world size 1: one whole iteration
    (forward, backward, step), its seconds and ATen operators against stock ZeRO-2's and the model's own operators
    (issue 35's host-time bar; the model alone is about half of stock's iteration)."""
    ours, stock = probe("lora-ops", out, "ts"), probe("lora-ops", out, "stock")
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours["losses"], stock["losses"])), (ours, stock)
    assert ours["host_syncs_per_iteration"] <= stock["host_syncs_per_iteration"], (ours, stock)
    model = sum(ours["model_ops"].values())
    beyond = [r["aten_ops_per_iteration"] - model for r in (ours, stock)]
    assert beyond[0] <= beyond[1] // 10, (beyond, ours, stock)
    assert ours["iteration_s"] is not None or EMULATED, "no iteration time (no CUDA device seen)"
    seconds = (
        "n/a (emulated)"
        if ours["iteration_s"] is None
        else f"{ours['iteration_s'] * 1e3:.1f} ms vs stock {stock['iteration_s'] * 1e3:.1f} "
        f"({ours['iteration_s'] / stock['iteration_s']:.2f}x)"
    )
    return (
        f"iteration {seconds}; ATen ops {ours['aten_ops_per_iteration']} vs "
        f"{stock['aten_ops_per_iteration']}, the model's own {model}; host syncs "
        f"{ours['host_syncs_per_iteration']} vs {stock['host_syncs_per_iteration']}"
    )


CHECKS: dict[str, Callable[[str], str]] = {
    "equivalence": check_equivalence,
    "offload": check_offload,
    "muon": check_muon,
    "compile": check_compile,
    "checkpoint": check_checkpoint,
    "offload_states": check_offload_states,
    "mpi": check_mpi,
    "step": check_step,
    "lora": check_lora,
    "stage3": check_stage3,
}


def main(out: str, names: list[str]) -> int:
    rows = []
    for name in names or list(CHECKS):
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        try:
            rows.append((name, "PASS", CHECKS[name](folder)))
        except BaseException as err:  # noqa: BLE001 - every way a check ends is a row
            traceback.print_exc()
            rows.append((name, "FAIL", f"{type(err).__name__}: {str(err).strip()[-300:]}".replace("\n", " ")))
        print(f"{rows[-1][1]} {name}", flush=True)
    print("\n| check | outcome | figure |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return sum(outcome != "PASS" for _, outcome, _ in rows)


if __name__ == "__main__":
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
