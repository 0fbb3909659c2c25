"""One rank of one benchmark configuration (started by ``ds-tensorshard bench`` under mpiexec).

Trains the GPT (or, ``--model lora``, the LoRA-like model) of :mod:`ds_tensorshard.commands.models` for
``--steps`` timed steps after ``--warmup`` steps and writes ``OUT/CONFIG.rankR.json``: per-step wall times
split into forward+backward, reduce (time spent after backward finishing gradient reduction; reduction
overlapped with backward counts in forward+backward), optimizer and gather, the process's CPU time per step
(every thread), every step's losses, the ATen operators and host syncs of one more step's ``step()``
(:mod:`.op_count`), plus peak RSS, optimizer-state bytes and the bytes this rank sent
through collectives (ring-algorithm model: all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n of
the full buffer; a reduce is sent once by every rank but its root, a broadcast once by every rank but the
one before its root, the last of the ring).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from ds_tensorshard.bench.op_count import OpCounter
from ds_tensorshard.commands.models import GPT, LORA_RANK, LoRAStack

CONFIGS = ("stage0", "zero1", "zero2", "ddp_zero", "fsdp2", "ts_torch", "ts_mpi")
# two models (the second half as wide and half as deep) trained in the same processes
TWO_MODEL_CONFIGS = ("two_zero2", "two_ts_separate", "two_ts_joint")
# ZeRO-Offload (offload_optimizer cpu, pinned): stock ZeRO-2's and ds_tensorshard's (torch and mpi transports)
OFFLOAD_CONFIGS = ("zero2_offload", "ts_offload", "ts_offload_mpi")
# bf16.bf16_master_weights_and_grads and bf16_optimizer_states (stage 2, no offload; --dtype bf16 only)
MASTER_CONFIGS = ("zero2_bf16_masters", "ts_bf16_masters")
# ds_tensorshard with each bucket_layout set explicitly (ts_torch and ts_mpi take the default, "auto")
LAYOUT_CONFIGS = (
    "ts_torch_windows",
    "ts_torch_stripes",
    "ts_torch_flat",
    "ts_mpi_windows",
    "ts_mpi_stripes",
    "ts_mpi_flat",
)
SHARDED = (
    "ts_torch",
    "ts_mpi",
    "ts_offload",
    "ts_offload_mpi",
    "two_ts_separate",
    "two_ts_joint",
    "ts_bf16_masters",
    *LAYOUT_CONFIGS,
)  # ds_tensorshard's
MPI_CONFIGS = ("ts_mpi", "ts_offload_mpi", "ts_mpi_windows", "ts_mpi_stripes", "ts_mpi_flat")
_SENT: defaultdict[str, float] = defaultdict(float)  # bytes sent by this rank, per collective kind
_FACTORS = {
    "all_reduce": lambda n, root, me: 2 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n, root, me: (n - 1) / n,
    "all_gather_into_tensor": lambda n, root, me: (n - 1) / n,
    "reduce_scatter_single": lambda n, root, me: (n - 1) / n,  # FSDP2 calls these (torch 2.13)
    "all_gather_single": lambda n, root, me: (n - 1) / n,
    "broadcast": lambda n, root, me: float(me != (root - 1) % n),
    "reduce": lambda n, root, me: float(me != root),
}
_FULL_BUFFER = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "reduce_scatter_tensor": "input",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_single": "input",
    "all_gather_single": "output_tensor",
}
_ROOT = {"broadcast": "src", "reduce": "dst"}


def _count_torch_collectives() -> None:
    """Wrap torch.distributed collectives (before DeepSpeed binds them) to add up bytes sent."""
    for name, factor in _FACTORS.items():
        original = getattr(tdist, name, None)
        if original is None:  # an older torch, whose FSDP2 calls the *_tensor ones
            continue
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, _original=original, _name=name, _factor=factor, _signature=signature, **kwargs):
            bound = _signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            n = tdist.get_world_size(group) if tdist.is_initialized() else 1
            me = tdist.get_rank(group) if tdist.is_initialized() else 0
            root = (
                tdist.get_group_rank(group, bound[_ROOT[_name]])
                if _name in _ROOT and group is not None
                else bound.get(_ROOT.get(_name, ""), 0)
            )
            tensor = bound[_FULL_BUFFER[_name]]
            _SENT[_name] += _factor(n, root, me) * tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)

        setattr(tdist, name, counted)


def _count_mpi_collectives() -> None:
    from ds_tensorshard.transports import mpi_comm

    rooted = (("start_reduce", "reduce"), ("start_broadcast", "broadcast"))
    whole = (("all_reduce_sum", "all_reduce"), ("start_all_reduce", "all_reduce"))  # the norm's; a routed stripe's
    for name, kind in rooted + whole:
        original = getattr(mpi_comm.MpiComm, name)

        @functools.wraps(original)
        def counted(self, tensor, *args, _original=original, _kind=kind):
            factor = _FACTORS[_kind](self.world_size, args[0] if args else 0, self.rank)
            _SENT["mpi_" + _kind] += factor * tensor.numel() * tensor.element_size()
            return _original(self, tensor, *args)

        setattr(mpi_comm.MpiComm, name, counted)
    for name, kind in (("start_reduce_segments", "reduce"), ("start_broadcast_segments", "broadcast")):
        original = getattr(mpi_comm.MpiComm, name)

        @functools.wraps(original)
        def counted_segments(self, flat, spans, _original=original, _kind=kind):
            for owner, _offset, numel in spans:  # as a rooted collective per owner would send
                _SENT["mpi_" + _kind] += (
                    _FACTORS[_kind](self.world_size, owner, self.rank) * numel * flat.element_size()
                )
            return _original(self, flat, spans)

        setattr(mpi_comm.MpiComm, name, counted_segments)
    for name in ("start_reduce_scatter", "start_all_gather"):  # a stripe: (n - 1) / n of its whole buffer
        original = getattr(mpi_comm.MpiComm, name)

        @functools.wraps(original)
        def counted_stripe(self, flat, slot, _original=original, _name=name):
            _SENT["mpi_" + _name] += (self.world_size - 1) / self.world_size * flat.numel() * flat.element_size()
            return _original(self, flat, slot)

        setattr(mpi_comm.MpiComm, name, counted_stripe)


class Clock:
    """Adds up wall time per phase, for wrapped functions and explicit blocks."""

    def __init__(self) -> None:
        self.spent: defaultdict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    @classmethod
    def of_gathers(cls) -> Clock:
        """A clock timing the parameters' return after the update as "gather": ours (per bucket, or the flat
        parameters' one collective) and stock ZeRO-1/2's all-gather."""
        from deepspeed.runtime.zero import stage_1_and_2

        from ds_tensorshard.datapath import broadcast, flat_parameters

        clock = cls()
        clock.wrap(broadcast.Broadcast, "finish", "gather")
        clock.wrap(flat_parameters.FlatParameters, "start_gather", "gather")
        clock.wrap(flat_parameters.FlatGather, "finish", "gather")
        clock.wrap(stage_1_and_2, "all_gather_dp_groups", "gather")
        return clock


def ds_config(name: str, micro: int, dtype: str, bucket: int | None, optimizer: str = "adamw") -> dict:
    stage = 0 if name == "stage0" else 1 if name == "zero1" else 2
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": OPTIMIZERS[optimizer],
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if bucket is not None:  # else every configuration keeps its own defaults
        config["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if name in MASTER_CONFIGS:
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    if name in OFFLOAD_CONFIGS:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if name in SHARDED:
        config["tensorshard"] = {"enabled": True, "comm_backend": "mpi" if name in MPI_CONFIGS else "torch"}
    if name in LAYOUT_CONFIGS:
        config["tensorshard"]["bucket_layout"] = name.rsplit("_", 1)[1]
    return config


def state_bytes(name: str, optimizer, model: torch.nn.Module) -> int:
    """Optimizer state held beyond the model's own tensors."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731  (FSDP2: this rank's shard)
    model_storage = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    if name == "ddp_zero":
        tensors = [t for s in optimizer.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    elif name == "fsdp2":
        tensors = [local(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    else:
        inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        if name in SHARDED:
            tensors += [m for g in optimizer.param_groups for m in g["params"]]
        elif name in ("zero1", "zero2", "zero2_offload", "two_zero2", "zero2_bf16_masters"):
            tensors += list(optimizer.single_partition_of_fp32_groups)
    return sum(t.numel() * t.element_size() for t in tensors if t.untyped_storage().data_ptr() not in model_storage)


def host_bytes(name: str, engine) -> int:
    """Bytes copied between the accelerator and host memory so far (on CPU: that would be copied). ds_tensorshard
    counts them (``optimizer.host.traffic``); stock ZeRO-Offload's are counted from its code: per step (GAS 1) its
    fp32 gradient partition to the host and its bit16 partition back (stage_1_and_2.py)."""
    optimizer = engine.optimizer
    if name in ("ts_offload", "ts_offload_mpi"):
        return optimizer.host.traffic.to_host + optimizer.host.traffic.to_device
    if name == "zero2_offload":
        partition = sum(t.numel() for t in optimizer.single_partition_of_fp32_groups)
        return engine.global_steps * partition * (4 + torch.finfo(engine.get_data_types()[0]).bits // 8)
    return 0


RUN_ARGUMENTS = (
    "layers",
    "width",
    "vocab",
    "seq",
    "global_batch",
    "dtype",
    "steps",
    "warmup",
    "bucket_numel",
    "optimizer",
    "model",
)
OPTIMIZERS = {  # --optimizer -> the config's optimizer block
    "adamw": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "muon": {"type": "Muon", "params": {"lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01}},
    "adafactor": {"type": "Adafactor", "params": {"lr": 1e-3}},
}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, batch and timing options, shared by ``ds-tensorshard bench`` and its workers."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--bucket-numel", type=int, help="bucket size for every configuration (default: each keeps its own)"
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="inner optimizer of every DeepSpeed configuration (muon: the blocks' matrices)",
    )
    parser.add_argument(
        "--model",
        choices=["gpt", "lora"],
        default="gpt",
        help="gpt: the GPT, every tensor trained; lora: a frozen base of --layers linear layers of --width, each "
        f"with a trainable rank-{LORA_RANK} adapter (2 x --layers small tensors)",
    )


def second_model_shape(width: int, layers: int) -> dict:
    """The second model of the two-model configurations: half as wide, half as deep."""
    half = max(16, width // 2)
    return dict(width=half, layers=max(1, layers // 2), heads=max(1, half // 64))


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


def build_fsdp2(model: torch.nn.Module, world: int, device: torch.device) -> Setup:
    """PyTorch FSDP2 in its ZeRO-2 form: ``fully_shard`` on every block and on the root, parameters kept
    unsharded from forward through backward (``reshard_after_forward=False``), AdamW on the sharded ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.get_submodule("blocks").children():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-4, weight_decay=0.01)

    def train(tokens: torch.Tensor) -> list[float]:
        loss = model(tokens)
        loss.backward()
        return [loss.item()]

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Setup([model], train, step, lambda: state_bytes("fsdp2", optimizer, model))


def build_ddp(model: torch.nn.Module, world: int, clock: Clock) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(trainable(model), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
    clock.wrap(optimizer, "_sync_params", "gather")

    def train(tokens: torch.Tensor) -> list[float]:
        loss = ddp(tokens)
        loss.backward()  # DDP all-reduces from C++, out of the Python counters' sight: modelled here
        _SENT["ddp_all_reduce"] += 2 * (world - 1) / world * sum(p.numel() * p.element_size() for p in trainable(model))
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


def newton_schulz_on_this_rank(name: str, engine) -> tuple[float, float]:
    """(this rank's Newton-Schulz work, the whole model's), in m n min(m, n) units: ds_tensorshard's owner
    orthogonalizes each matrix once; stock ZeRO orthogonalizes every matrix its flat slice touches (each
    Muon param group flattened and split evenly); stage 0 orthogonalizes everything on every rank."""
    import ds_tensorshard
    from ds_tensorshard.datapath.inner_optimizer import newton_schulz_work

    optimizer = engine.optimizer
    if isinstance(optimizer, ds_tensorshard.TensorShardOptimizer):
        work = optimizer.plan.work_per_rank
        return (work[optimizer.comm.rank], sum(work)) if work else (0.0, 0.0)
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = [g["params"] for g in inner.param_groups if g.get("use_muon")]
    if name == "stage0":
        total = sum(newton_schulz_work(tuple(p.shape)) for group in groups for p in group if p.dim() >= 2)
        return total, total
    n, rank = optimizer.partition_count[0], tdist.get_rank(optimizer.dp_process_group)
    mine, total = 0.0, 0.0
    for group in (g for g in optimizer.bit16_groups if getattr(g[0], "use_muon", False)):
        part = -(-sum(p.numel() for p in group) // n)
        offset = 0
        for p in group:
            cost = newton_schulz_work(tuple(p.shape)) if p.dim() >= 2 else 0.0
            total += cost
            if offset < (rank + 1) * part and offset + p.numel() > rank * part:
                mine += cost
            offset += p.numel()
    return mine, total


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "config", choices=CONFIGS + OFFLOAD_CONFIGS + MASTER_CONFIGS + LAYOUT_CONFIGS + TWO_MODEL_CONFIGS
    )
    parser.add_argument("out")
    add_run_arguments(parser)
    parser.add_argument("--port", type=int, default=29500)
    args = parser.parse_args()

    _count_torch_collectives()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ds_tensorshard.commands.models import synthetic_batch
    from ds_tensorshard.transports.torch_comm import close_process_group

    _count_mpi_collectives()
    on_gpu = get_accelerator().device_name() == "cuda"  # DS_ACCELERATOR=cuda: one GPU per rank, NCCL
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", distributed_port=args.port)
    world, rank = tdist.get_world_size(), tdist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    micro = args.global_batch // world
    torch.manual_seed(0)
    shapes = [dict(width=args.width, layers=args.layers, heads=max(1, args.width // 64))]
    if args.config in TWO_MODEL_CONFIGS:
        shapes.append(second_model_shape(args.width, args.layers))
    models = [build_model(args, shape).to(device) for shape in shapes]
    clock = Clock.of_gathers()
    if args.config in ("ddp_zero", "fsdp2"):
        model = models[0].to(torch.bfloat16) if args.dtype == "bf16" else models[0]
        setup = build_ddp(model, world, clock) if args.config == "ddp_zero" else build_fsdp2(model, world, device)
    else:
        setup = build_deepspeed(args.config, models, micro, args, clock)
    generator = torch.Generator().manual_seed(100 + rank)
    rows, losses_by_step = [], []
    for index in range(args.warmup + args.steps):
        tokens = synthetic_batch(micro, args.seq, args.vocab, generator).to(device)
        clock.spent.clear()
        sent_before, host_before = sum(_SENT.values()), setup.host_bytes()
        tdist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        losses = setup.train(tokens)
        get_accelerator().synchronize()
        after_backward = time.perf_counter()
        setup.step()
        get_accelerator().synchronize()
        end, cpu_end = time.perf_counter(), time.process_time()
        losses_by_step.append(losses)
        if index >= args.warmup:
            reduce, gather_s = clock.spent["reduce"], clock.spent["gather"]
            rows.append(
                {
                    "step_s": end - start,
                    "cpu_s": cpu_end - cpu_start,
                    "fwd_bwd_s": after_backward - start - reduce,
                    "reduce_s": reduce,
                    "optimizer_s": end - after_backward - gather_s,
                    "gather_s": gather_s,
                    "sent_bytes": sum(_SENT.values()) - sent_before,
                    "host_bytes": setup.host_bytes() - host_before,
                    "losses": losses,
                }
            )
    tokens = synthetic_batch(micro, args.seq, args.vocab, generator).to(device)
    result = {
        **count_step(setup, tokens),  # one more step, untimed
        "config": args.config,
        "rank": rank,
        "world_size": world,
        "steps": rows,
        "losses_by_step": losses_by_step,
        "numel": sum(p.numel() for m in setup.models for p in trainable(m)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "optimizer_state_bytes": setup.state_bytes(),
    }
    if args.optimizer == "muon":
        result["newton_schulz_work"], result["newton_schulz_total"] = setup.newton_schulz()
    with open(os.path.join(args.out, f"{args.config}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del setup, models  # DDP's reducer keeps gloo work alive until collected
    close_process_group()


if __name__ == "__main__":
    main()
