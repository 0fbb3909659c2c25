"""Each benchmark configuration built on this rank: its models, a forward+backward of all of them, their step,
and what it holds (:class:`Setup`); DDP + ZeroRedundancyOptimizer, FSDP2 and DeepSpeed's engines."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_tensorshard.bench.accounting import host_bytes, newton_schulz_on_this_rank, state_bytes
from ds_tensorshard.bench.clock import Clock
from ds_tensorshard.bench.configs import SHARDED, ds_config
from ds_tensorshard.bench.op_count import OpCounter
from ds_tensorshard.bench.traffic import SENT
from ds_tensorshard.commands.models import GPT, LoRAStack


@dataclass
class Setup:
    """One configuration, built: its models, a forward+backward of all of them, and their step."""

    models: list[torch.nn.Module]
    train: Callable[[torch.Tensor], list[float]]
    step: Callable[[], None]
    state_bytes: Callable[[], int]
    newton_schulz: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)
    host_bytes: Callable[[], int] = lambda: 0  # copied between the accelerator and the host so far (offload)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_model(args: argparse.Namespace, shape: dict) -> torch.nn.Module:
    if args.model == "lora":
        return LoRAStack(vocab=args.vocab, seq=args.seq, width=shape["width"], layers=shape["layers"])
    return GPT(vocab=args.vocab, seq=args.seq, **shape)


def build_fsdp2(model: torch.nn.Module, world: int, device: torch.device, reshard: bool = False) -> Setup:
    """PyTorch FSDP2: ``fully_shard`` on every block and on the root, AdamW on the sharded parameters. Its ZeRO-2
    form keeps them unsharded from forward through backward (``reshard_after_forward=False``); with ``reshard``,
    its ZeRO-3 form, each block's are sharded again after its forward and gathered again for its backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.get_submodule("blocks").children():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-4, weight_decay=0.01)

    def train(tokens: torch.Tensor) -> list[float]:
        loss = model(tokens)
        loss.backward()
        return [loss.item()]

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Setup([model], train, step, lambda: state_bytes("fsdp2_reshard" if reshard else "fsdp2", optimizer, model))


def build_ddp(model: torch.nn.Module, world: int, clock: Clock) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(trainable(model), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
    clock.wrap(optimizer, "_sync_params", "gather")

    def train(tokens: torch.Tensor) -> list[float]:
        loss = ddp(tokens)
        loss.backward()  # DDP all-reduces from C++, out of the Python counters' sight: modelled here
        SENT["ddp_all_reduce"] += 2 * (world - 1) / world * sum(p.numel() * p.element_size() for p in trainable(model))
        return [loss.item()]

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Setup([model], train, step, lambda: state_bytes("ddp_zero", optimizer, model))


def build_deepspeed(
    name: str, models: Sequence[torch.nn.Module], micro: int, args: argparse.Namespace, clock: Clock
) -> Setup:
    import deepspeed

    import ds_tensorshard

    if args.optimizer == "muon":  # Muon on the blocks' matrices, its auxiliary Adam on the rest
        for model in models:
            for pname, p in model.named_parameters():
                setattr(p, "use_muon", p.dim() >= 2 and pname.startswith("blocks."))  # noqa: B010
    items = [
        dict(
            model=m,
            model_parameters=trainable(m),
            config=ds_config(name, micro, args.dtype, args.bucket_numel, args.optimizer),
        )
        for m in models
    ]
    if name == "two_ts_joint":
        engines = [result[0] for result in ds_tensorshard.initialize_many(items)]
    else:
        engines = [deepspeed.initialize(**item)[0] for item in items]
    for engine in engines:
        clock.wrap(engine, "allreduce_gradients", "reduce")
        if name in SHARDED:
            assert isinstance(engine.optimizer, ds_tensorshard.TensorShardOptimizer)

    def train(tokens: torch.Tensor) -> list[float]:
        losses = []
        for engine in engines:
            loss = engine(tokens)
            engine.backward(loss)
            losses.append(loss.item())
        return losses

    def step() -> None:
        if name == "two_ts_joint":
            ds_tensorshard.step_many(engines)
        else:
            for engine in engines:
                engine.step()

    setup = Setup(list(models), train, step, lambda: sum(state_bytes(name, e.optimizer, e.module) for e in engines))
    setup.host_bytes = lambda: sum(host_bytes(name, e) for e in engines)
    setup.newton_schulz = lambda: newton_schulz_on_this_rank(name, engines[0])
    return setup


def count_step(setup: Setup, tokens: torch.Tensor) -> dict[str, Any]:
    """A training step whose step (after backward) runs under an :class:`~.op_count.OpCounter`: the ATen
    operators it dispatches and the host syncs among them (untimed: counting slows every operator down)."""
    setup.train(tokens)
    with OpCounter() as counted:
        setup.step()
    return {
        "aten_ops_per_step": counted.total,
        "host_syncs_per_step": counted.host_syncs,
        "aten_ops_by_name": dict(counted.ops.most_common()),
    }
