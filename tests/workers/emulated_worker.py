"""One rank of the checks that look inside a rank on emulated CUDA (tests/multiprocess/test_cuda_emulated.py),
also run on the CPU for contrast: python emulated_worker.py CHECK OUT

``offload-states``: train, ``engine.offload_states()``, the device memory before and after (allocated and
reserved, as torch.cuda's caching allocator reports them), where each state went, ``reload_states()``, train on.
``host-waits``: a 32-bucket model (TinyGPT, 900-element buckets); every wait on a collective during backward is
recorded with whether it blocks the host and whether it ran inside a gradient hook, and so is every host sync
(``.item()``, a blocking device-to-host copy, a stream or event synchronize) inside a hook. Writes OUT.rankR.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
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


def engine_of(config: dict) -> Any:
    torch.manual_seed(1234)
    with model_device():
        model = TinyGPT(vocab=VOCAB, seq=SEQ)
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


def offload_states(rank: int, world: int) -> dict:
    engine = engine_of(ds_config("fp32", "ts", 2, world))
    accelerator, optimizer = get_accelerator(), engine.optimizer
    losses = train(engine, rank, 2)
    before = (accelerator.memory_allocated(), accelerator.memory_reserved())
    engine.offload_states()
    after = (accelerator.memory_allocated(), accelerator.memory_reserved())
    states = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    where = {
        "params": sorted({str(p.device) for p in optimizer.params}),  # the trained ones, as stock's bit16_groups
        "masters": sorted({str(m.device) for m in optimizer.shard.masters.values()}),
        "optimizer state": sorted({str(t.device) for t in states}),
        "pinned": all(t.is_pinned() for t in [*states, *optimizer.params]),
    }
    engine.reload_states()
    reloaded = sorted({str(p.device) for p in engine.module.parameters()})
    return {
        "losses": losses + train(engine, rank, 2, first=100),
        "before": before,
        "after": after,
        "offloaded": where,
        "reloaded": reloaded,
    }


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
        ready, start = reducer.gradient_ready, reducer.comm

        def gradient_ready(param: torch.nn.Parameter) -> None:
            self.local.hook = True
            try:
                ready(param)
            finally:
                self.local.hook = False

        reducer.gradient_ready = gradient_ready
        reducer.comm = CountingTransport(start, self)


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


def host_waits(rank: int, world: int) -> dict:
    config = ds_config("fp32", "ts", 2, world)
    config["tensorshard"]["bucket_numel"] = 900
    engine = engine_of(config)
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
        "losses": losses,
    }


CHECKS = {"offload-states": offload_states, "host-waits": host_waits}


def main() -> None:
    check, out = sys.argv[1], sys.argv[2]
    init_worker()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = CHECKS[check](rank, world)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    close_process_group()


if __name__ == "__main__":
    main()
