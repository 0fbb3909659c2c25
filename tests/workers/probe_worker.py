"""One rank of the checks that look inside a rank: on emulated CUDA (tests/multiprocess/test_cuda_emulated.py,
also run on the CPU for contrast) or on a GPU (launch/gpu_check.sh).

    python probe_worker.py CHECK OUT [MODE]      MODE ts (default) or stock; writes OUT.rankR.json

``offload-states``: train, ``engine.offload_states()``, the device memory before and after (allocated and
reserved, as torch.cuda's caching allocator reports them), where each state went, ``reload_states()``, train on.
``host-waits``: a 32-bucket model (TinyGPT, 900-element buckets); every wait on a collective during backward is
recorded with whether it blocks the host and whether it ran inside a gradient hook, and so is every host sync
(``.item()``, a blocking device-to-host copy, a stream or event synchronize) inside a hook.
``step``: a GPT of ``PROBE_WIDTH`` x ``PROBE_LAYERS`` (default about 1B parameters) in bf16 at this world size,
ZeRO stage ``PROBE_STAGE`` (default 2; at 3 ``PROBE_OFFLOAD_PARAM=1`` adds ``offload_param`` device cpu, pinned):
seconds per step, the ATen operators and host syncs ``engine.step()`` dispatches, the peak device memory (on
emulated CUDA the largest of samples around every module and the step) and, on
a GPU, the longest gap between kernels during a backward (torch.profiler).
``lora-ops``: the LoRA-like model with 1,000 adapted layers (2,000 trained tensors), fp32, stage ``PROBE_STAGE``
(default 2; at 3 ``PROBE_PERSISTENCE`` sets ``stage3_param_persistence_threshold``), both sides otherwise at
their defaults: the ATen operators and host syncs of the second ``engine.step()``, of its backward and of its
whole iteration, the model's own forward and backward before any engine (``model_ops``), what backward
dispatched beyond those (``extra_backward``, by name), the losses, and on a GPU the median seconds of 3 more
iterations.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.protocol import Pending
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.emulated_accelerator import emulating, init_worker, model_device
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, batch, ds_config, param_groups


def engine_of(config: dict, model: torch.nn.Module | None = None) -> Any:
    torch.manual_seed(1234)
    with model_device():
        model = model or TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def train(engine: Any, rank: int, steps: int, first: int = 0) -> list[float]:
    losses = []
    for micro in range(first, first + steps * engine.gradient_accumulation_steps()):
        loss = engine(batch(rank, micro).to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def offload_states(rank: int, world: int, mode: str) -> dict:
    stage = int(os.environ.get("PROBE_STAGE", "2"))
    engine = engine_of(ds_config("fp32", mode, stage, world))
    accelerator, optimizer = get_accelerator(), engine.optimizer

    def kept() -> list[torch.Tensor]:
        """What this rank keeps of the model: the trained tensors (stock's bit16_groups), at stage 3 every
        parameter's ds_tensor (its owned block; an empty placeholder where it owns none)."""
        return [p.ds_tensor for p in engine.module.parameters()] if stage == 3 else list(optimizer.params)

    losses = train(engine, rank, 2)
    before = (accelerator.memory_allocated(), accelerator.memory_reserved())
    engine.offload_states()
    result: dict[str, Any] = {
        "before": before,
        "after": (accelerator.memory_allocated(), accelerator.memory_reserved()),
    }
    if mode == "ts":
        states = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        result["offloaded"] = {
            "params": sorted({str(t.device) for t in kept()}),
            "masters": sorted({str(m.device) for m in optimizer.shard.masters.values()}),
            "optimizer state": sorted({str(t.device) for t in states}),
            "pinned": all(t.is_pinned() for t in [*states, *kept()] if t.numel()),
        }
    engine.reload_states()
    result["reloaded"] = sorted({str(t.device) for t in kept() if t.requires_grad or stage == 3})
    result["losses"] = losses + train(engine, rank, 2, first=100)
    return result


class Probe:
    """Records what the host waits for during backward: collective waits (blocking the host or not) and host
    syncs, each inside a gradient hook or not."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.waits: list[tuple[bool, bool]] = []  # (blocks the host, inside a hook)
        self.syncs_in_hooks: list[str] = []

    def in_hook(self) -> bool:
        return getattr(self.local, "hook", False)

    def hooked(self, reducer: Any) -> None:
        """Mark the reducer's entry from the gradient hooks, and record every wait on its collectives."""
        ready = reducer.gradient_ready

        def gradient_ready(param: torch.nn.Parameter) -> None:
            self.local.hook = True
            try:
                ready(param)
            finally:
                self.local.hook = False

        reducer.gradient_ready = gradient_ready
        reducer.comm = CountingTransport(reducer.comm, self)


class CountingTransport:
    """A transport that records every wait on the collectives it starts (the instrumented transport)."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self.inner, self.probe = inner, probe

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        if not name.startswith("start_"):
            return found

        def started(*args: Any, **kwargs: Any) -> Pending:
            pending = found(*args, **kwargs)
            wait = pending.wait

            def counted() -> Any:
                self.probe.waits.append((pending.blocks_host, self.probe.in_hook()))
                return wait()

            pending.wait = counted  # type: ignore[method-assign]
            return pending

        return started


def host_waits(rank: int, world: int, mode: str) -> dict:
    """``mode`` ts, or ts-offload: ZeRO-Offload in bf16 without clipping or overflow check, where each tensor is
    updated as its last piece arrives (datapath/early_update.py); then also where the host optimizer ran."""
    dtype = "bf16" if mode == "ts-offload" else "fp32"
    config = ds_config(dtype, mode, 2, world)
    config["tensorshard"]["bucket_numel"] = 900
    if mode == "ts-offload":
        config["gradient_clipping"] = 0.0
        config["bf16"]["check_grad_overflow"] = False
    engine = engine_of(config)
    host_steps: list[str] = []
    inner = engine.optimizer.optimizer
    inner_step = inner.step
    inner.step = lambda *a, **k: (host_steps.append(threading.current_thread().name), inner_step(*a, **k))[1]
    probe = Probe()
    for domain in engine.optimizer.domains.values():
        probe.hooked(domain.reducer)
    if emulating():
        from tests.helpers.emulated_cuda import LEDGER

        LEDGER.on_sync.append(lambda why: probe.syncs_in_hooks.append(why) if probe.in_hook() else None)
    losses = train(engine, rank, 3)
    hooks = [blocks for blocks, inside in probe.waits if inside]
    return {
        "buckets": len(engine.optimizer.buckets),
        "waits_in_hooks": len(hooks),
        "host_blocking_waits_in_hooks": sum(hooks),
        "waits_after_backward": sum(1 for _, inside in probe.waits if not inside),
        "host_syncs_in_hooks": probe.syncs_in_hooks,
        "host_optimizer_threads": sorted(set(host_steps)),
        "losses": losses,
    }


def longest_gap_in_backward(engine: Any, tokens: torch.Tensor) -> float | None:
    """Seconds of the longest gap between two kernels on the GPU during one backward (torch.profiler); None
    where there is no GPU to profile."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    loss = engine(tokens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.backward(loss)
        torch.cuda.synchronize()
    engine.step()
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"
    )  # microseconds
    gaps = [b[0] - a[1] for a, b in zip(kernels, kernels[1:])]
    return max(gaps, default=0.0) * 1e-6


def step(rank: int, world: int, mode: str) -> dict:
    from ds_tensorshard.bench.op_count import OpCounter
    from ds_tensorshard.commands.models import GPT

    width, layers = int(os.environ.get("PROBE_WIDTH", 2048)), int(os.environ.get("PROBE_LAYERS", 20))
    vocab, seq = 32000, 512
    config = at_defaults(ds_config("bf16", mode, int(os.environ.get("PROBE_STAGE", "2")), world), world)
    if os.environ.get("PROBE_OFFLOAD_PARAM") == "1":
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    torch.manual_seed(1234)
    with model_device():
        model = GPT(vocab=vocab, seq=seq, width=width, layers=layers, heads=max(1, width // 128))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    accelerator = get_accelerator()
    sample = sample_device_memory(model) if emulating() else lambda: None
    tokens = torch.randint(0, vocab, (1, seq)).to(engine.device)
    times, counts = [], []
    for index in range(5):  # 2 to warm up, 3 timed
        accelerator.synchronize()
        start = time.perf_counter()
        engine.backward(engine(tokens))
        sample()
        with OpCounter() as counter:
            engine.step()
        sample()
        accelerator.synchronize()
        if index >= 2:
            times.append(time.perf_counter() - start)
            counts.append((counter.total, counter.host_syncs))
    return {
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "step_s": sorted(times)[len(times) // 2],
        "aten_ops_per_step": counts[-1][0],
        "host_syncs_per_step": counts[-1][1],
        "peak_bytes": accelerator.max_memory_allocated(),
        "longest_gap_in_backward_s": longest_gap_in_backward(engine, tokens),
    }


def sample_device_memory(model: torch.nn.Module) -> Any:
    """On emulated CUDA, whose peak is the largest sample (tests/helpers/emulated_accelerator.py): the device
    memory read before and after every module's forward and backward; returns the sampler, for around the step."""
    accelerator = get_accelerator()

    def sample(*_: Any) -> None:  # a hook that returns nothing: the inputs and outputs stay as they are
        accelerator.memory_allocated()

    for module in model.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
        module.register_full_backward_pre_hook(sample)
        module.register_full_backward_hook(sample)
    return sample


def at_defaults(config: dict, world: int) -> dict:
    """An equivalence config with one micro-batch per step, no scheduler, and stock's and ds_tensorshard's buckets
    at their defaults, as a user runs them."""
    config.update(gradient_accumulation_steps=1, train_batch_size=world, train_micro_batch_size_per_gpu=1)
    config.pop("scheduler")
    config["zero_optimization"].pop("reduce_bucket_size")
    config.get("tensorshard", {}).pop("bucket_layout", None)
    return config


def iteration_seconds(engine: Any, tokens: torch.Tensor) -> float | None:
    """On a GPU, the median seconds of 3 whole iterations (for a small model, the host issuing them); None
    elsewhere (on CPU ranks or emulated CUDA the host also computes: the bench measures that)."""
    if not torch.cuda.is_available():
        return None
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.backward(engine(tokens))
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def lora_ops(rank: int, world: int, mode: str) -> dict:
    from ds_tensorshard.bench.op_count import OpCounter
    from ds_tensorshard.commands.models import LoRAStack

    torch.manual_seed(1234)
    with model_device():
        model = LoRAStack(vocab=1024, seq=32, width=128, layers=int(os.environ.get("PROBE_LORA_LAYERS", 1000)))
    trained = [p for p in model.parameters() if p.requires_grad]
    tokens = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(rank))
    tokens = tokens.to(trained[0].device)
    with OpCounter() as bare_forward:  # the model's own, before any engine
        loss = model(tokens)
    with OpCounter() as bare_backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    config = at_defaults(ds_config("fp32", mode, int(os.environ.get("PROBE_STAGE", "2")), world), world)
    if "PROBE_PERSISTENCE" in os.environ:  # stage 3: stage3_param_persistence_threshold (0: every tensor gathered)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = int(os.environ["PROBE_PERSISTENCE"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trained, config=config)
    tokens = tokens.to(engine.device)  # a model built on the host (a GPU run) is on the device now
    losses = []
    # the third iteration counted: the first makes the optimizer state (and at stage 3 records the trace), the
    # second is the first to prefetch (the shared-memory lane's boxes grow to its batches, agreed once)
    for _ in range(3):
        with OpCounter() as iteration:
            loss = engine(tokens)
            with OpCounter() as backward:
                engine.backward(loss)
            with OpCounter() as counter:
                engine.step()
        losses.append(loss.item())
    return {
        "tensors": len(trained),
        "iteration_s": iteration_seconds(engine, tokens),
        "aten_ops_per_step": counter.total,
        "ops": dict(counter.ops),
        "host_syncs_per_step": counter.host_syncs,
        "aten_ops_in_backward": backward.total,
        "model_ops": {"forward": bare_forward.total, "backward": bare_backward.total},
        "extra_backward": dict(backward.ops - bare_backward.ops),
        "aten_ops_per_iteration": iteration.total,
        "host_syncs_per_iteration": iteration.host_syncs,
        "losses": losses,
    }


CHECKS = {"offload-states": offload_states, "host-waits": host_waits, "step": step, "lora-ops": lora_ops}


def main() -> None:
    check, out, *mode = sys.argv[1:]
    init_worker()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = CHECKS[check](rank, world, mode[0] if mode else "ts")
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    close_process_group()


if __name__ == "__main__":
    main()
