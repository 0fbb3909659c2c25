"""The emulated-CUDA tier's checks that look inside a rank (tests/workers/probe_worker.py), each against the
same run on the CPU. The tier's other checks sit beside the CPU runs they compare with: -m cuda_emulated."""

from __future__ import annotations

import json
import os

import pytest

from ds_tensorshard.datapath.gradients import NORM_CHUNK
from tests.helpers import WORKERS
from tests.helpers.emulated_accelerator import EMULATED
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.cuda_emulated
WORKER = os.path.join(WORKERS, "probe_worker.py")


def run(
    check: str, out, world: int = 2, emulated: bool = True, mode: str = "ts", env: dict | None = None
) -> list[dict]:
    run_ranks([WORKER, check, str(out), mode], world, env=(EMULATED if emulated else {}) | (env or {}))
    return [json.load(open(f"{out}.rank{rank}.json")) for rank in range(world)]


def test_no_host_blocking_wait_inside_a_gradient_hook(tmp_path):
    """A 32-bucket model, 3 steps: on the accelerator every wait on a reduction that backward's gradient hooks
    make (the oldest completing when a third bucket starts) is in stream order, and nothing in a hook syncs the
    host; on gloo, where the host is the stream, the same waits block it (what the probe would see)."""
    ours, cpu = run("host-waits", tmp_path / "cuda"), run("host-waits", tmp_path / "cpu", emulated=False)
    for rank in range(2):
        assert ours[rank]["buckets"] >= 32 and ours[rank]["waits_in_hooks"] > 0, ours[rank]
        assert ours[rank]["host_blocking_waits_in_hooks"] == 0 and ours[rank]["host_syncs_in_hooks"] == []
        assert cpu[rank]["host_blocking_waits_in_hooks"] == cpu[rank]["waits_in_hooks"] == ours[rank]["waits_in_hooks"]
        assert ours[rank]["losses"] == cpu[rank]["losses"]


@pytest.mark.extended  # CI time (22 s): offload_states in one CPU rank stays (tests/unit/test_offload.py)
def test_offload_states_frees_the_device_memory_as_stock(tmp_path):
    """engine.offload_states() after 2 steps (fp32, stage 2): the trained tensors, the masters (views of an fp32
    model's tensors) and the optimizer state go to pinned host memory, the device's allocated memory falls to
    132 bytes and its reserved memory with it (the caching allocator's blocks given back);
    reload_states() brings every tensor back and training goes on as on the CPU."""
    ours, cpu = run("offload-states", tmp_path / "cuda"), run("offload-states", tmp_path / "cpu", emulated=False)
    for rank in range(2):
        (allocated, reserved), after = ours[rank]["before"], ours[rank]["after"]
        assert allocated == reserved and allocated > 100_000, ours[rank]
        # what stays: the frozen parameter (32 fp32, never trained) and FusedAdam's 4-byte overflow flag
        assert after == [132, 132], ours[rank]
        offloaded = ours[rank]["offloaded"]
        assert offloaded == {"params": ["cpu"], "masters": ["cpu"], "optimizer state": ["cpu"], "pinned": True}
        assert ours[rank]["reloaded"] == [f"cuda:{rank}"]
        assert ours[rank]["losses"] == cpu[rank]["losses"]


def test_stage3_offload_states_frees_the_device_memory_and_training_goes_on(tmp_path):
    """engine.offload_states() at stage 3 after 2 steps (fp32): the gathered parameters (the persistent ones too)
    released, then what each rank keeps of every parameter (its ds_tensor), the masters (views of them) and the
    optimizer state in pinned host memory: the device's allocated memory falls from about 396 KB to a few bytes
    (12 measured: FusedAdam's overflow flag and scalars); reload_states() brings them back, gathers the persistent
    ones again, and training goes on as on the CPU, bit for bit."""
    env = {"PROBE_STAGE": "3"}
    ours = run("offload-states", tmp_path / "cuda", env=env)
    cpu = run("offload-states", tmp_path / "cpu", emulated=False, env=env)
    for rank in range(2):
        (allocated, reserved), after = ours[rank]["before"], ours[rank]["after"]
        assert allocated == reserved and allocated > 300_000, ours[rank]
        assert after[0] == after[1] <= 16, ours[rank]
        offloaded = ours[rank]["offloaded"]
        assert offloaded == {"params": ["cpu"], "masters": ["cpu"], "optimizer state": ["cpu"], "pinned": True}
        assert ours[rank]["reloaded"] == [f"cuda:{rank}"]
        assert ours[rank]["losses"] == cpu[rank]["losses"]


@pytest.mark.extended  # CI time
def test_zero_offload_keeps_the_host_work_off_the_autograd_thread(tmp_path):
    """ZeRO-Offload where each tensor is updated as its last reduced piece arrives (bf16, no clipping), 32
    buckets: a gradient hook only starts each segment's copy to pinned host memory (non-blocking, an event after
    it): nothing in a hook waits on the host; the host adds the segments and runs the host optimizer on its
    worker thread, once each copy's event is synchronized (a read before would be an error here). The CPU
    run's training."""
    ours = run("host-waits", tmp_path / "cuda", mode="ts-offload")
    cpu = run("host-waits", tmp_path / "cpu", emulated=False, mode="ts-offload")
    for rank in range(2):
        assert ours[rank]["buckets"] >= 32 and ours[rank]["waits_in_hooks"] > 0, ours[rank]
        assert ours[rank]["host_blocking_waits_in_hooks"] == 0 and ours[rank]["host_syncs_in_hooks"] == []
        assert ours[rank]["host_optimizer_threads"] == cpu[rank]["host_optimizer_threads"] == ["ds_tensorshard-host"]
        assert ours[rank]["losses"] == cpu[rank]["losses"]


@pytest.mark.parametrize(
    "emulated",
    # CI time: the 1,000-layer model through emulated dispatch takes 60-70 s; the CPU twin (default suite) counts
    # the same step on the same 2,000 tensors; `pytest -m cuda_emulated` runs the emulated one with the tier
    # CI time (25 s): the CPU one too; test_on_emulated_cuda_a_step_dispatches_no_operator_per_tensor stays
    [pytest.param(True, marks=pytest.mark.extended), pytest.param(False, marks=pytest.mark.extended)],
    ids=["cuda", "cpu"],
)
def test_step_operators_do_not_grow_with_the_tensor_count(tmp_path, emulated):
    """The LoRA-like model's 2,000 trained tensors at one rank (fp32, stage 2, clipping, defaults): one
    engine.step() dispatches at most stock ZeRO-2's ATen operators and at most a tenth of the 30,045 the
    per-tensor step dispatched (measured before the step path went by buffer), with at most stock's host syncs;
    on emulated CUDA and on the CPU alike, the same losses as stock."""
    (ours,), (stock,) = (run("lora-ops", tmp_path / mode, 1, emulated, mode) for mode in ("ts", "stock"))
    assert ours["tensors"] == 2000, ours
    assert ours["aten_ops_per_step"] <= min(stock["aten_ops_per_step"], 30_045 // 10), (ours, stock)
    assert ours["host_syncs_per_step"] <= stock["host_syncs_per_step"], (ours, stock)
    assert ours["losses"] == stock["losses"], (ours, stock)
    # the whole iteration (forward, backward, step): beyond the model's own operators (the same on both sides),
    # ours dispatch at most a tenth of stock ZeRO-2's (measured: 4,090 against 42,074 on the CPU)
    assert ours["model_ops"] == stock["model_ops"], (ours, stock)
    beyond = [r["aten_ops_per_iteration"] - sum(r["model_ops"].values()) for r in (ours, stock)]
    assert 0 < beyond[0] <= beyond[1] // 10, (beyond, ours, stock)
    assert ours["host_syncs_per_iteration"] <= stock["host_syncs_per_iteration"], (ours, stock)


@pytest.mark.extended  # CI time: about 3 min each (4 runs of the 1,000-layer model at 2 ranks)
@pytest.mark.parametrize("persistence", [None, 0], ids=["defaults", "threshold0"])
def test_stage3_lora_iteration_dispatches_at_most_stock_zero3s(tmp_path, persistence):
    """ZeRO stage 3 on the LoRA-like model's 2,000 trained tensors (and 1,000 frozen ones), 2 ranks on the CPU,
    at the defaults (every tensor below stage3_param_persistence_threshold: kept on every rank) and with the
    threshold 0 (every tensor gathered around its module): on every rank one engine.step() and one whole
    iteration dispatch at most stock ZeRO-3's ATen operators and host syncs, with the same losses."""
    env = {"PROBE_STAGE": "3"} | ({} if persistence is None else {"PROBE_PERSISTENCE": str(persistence)})
    ours, stock = (run("lora-ops", tmp_path / mode, 2, False, mode, env) for mode in ("ts", "stock"))
    for rank in range(2):
        assert ours[rank]["tensors"] == 2000, ours[rank]
        for key in ("aten_ops_per_step", "host_syncs_per_step", "aten_ops_per_iteration", "host_syncs_per_iteration"):
            assert ours[rank][key] <= stock[rank][key], (key, rank, ours[rank], stock[rank])
        assert ours[rank]["losses"] == stock[rank]["losses"], (ours[rank], stock[rank])


def test_on_emulated_cuda_a_step_dispatches_no_operator_per_tensor(tmp_path):
    """The step path by buffer on emulated CUDA, in the default suite (the 2,000-tensor count against stock is its
    ``extended`` twin above): one engine.step() of the LoRA-like model with 100 and with 300 adapted layers (200 and
    600 trained tensors, one bucket each) dispatches the same ATen operators and host syncs, but for the norm's
    fp64 pass over the larger buffer in one chunk more (a slice, a copy to fp64, a dot, an add: by elements, per
    ``NORM_CHUNK``, never per tensor)."""
    small, large = (run("lora-ops", tmp_path / str(n), 1, env={"PROBE_LORA_LAYERS": str(n)})[0] for n in (100, 300))
    assert (small["tensors"], large["tensors"]) == (200, 600)
    chunks = [-(-r["tensors"] * 2048 // NORM_CHUNK) for r in (small, large)]  # 2,048 elements per adapter tensor
    assert chunks == [1, 2]
    per_chunk = {"aten.slice": 1, "aten.copy_": 1, "aten.dot": 1, "aten.add_": 1}
    grown = {k: large["ops"].get(k, 0) - small["ops"].get(k, 0) for k in set(small["ops"]) | set(large["ops"])}
    assert {k: v for k, v in grown.items() if v} == per_chunk, (small, large)
    assert small["host_syncs_per_step"] == large["host_syncs_per_step"] <= 1, (small, large)
    for r in (small, large):  # forward: the model's own operators, nothing of ours
        forward = r["aten_ops_per_iteration"] - r["aten_ops_in_backward"] - r["aten_ops_per_step"]
        assert forward == r["model_ops"]["forward"], r
    # backward beyond the model's own: per tensor only views (its gradient flattened into the bucket, its part
    # of the reduced segment: no kernel); the kernels and collectives per bucket, the same at 200 and 600 tensors
    views = {"aten.view", "aten.slice"}
    kernels = [{k: v for k, v in r["extra_backward"].items() if k not in views} for r in (small, large)]
    assert kernels[0] == kernels[1] and sum(kernels[0].values()) <= 16, kernels
    for r in (small, large):
        assert sum(r["extra_backward"].get(k, 0) for k in views) <= 2 * r["tensors"] + 2, r
