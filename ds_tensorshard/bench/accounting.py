"""What one configuration holds and does on a rank, beyond time: optimizer state beyond the model's own tensors,
bytes between the accelerator and host memory (ZeRO-Offload), and Muon's Newton-Schulz work."""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from ds_tensorshard.bench.configs import SHARDED


def state_bytes(name: str, optimizer, model: torch.nn.Module) -> int:
    """Optimizer state held beyond the model's own tensors."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731  (FSDP2: this rank's shard)
    model_storage = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    model_storage |= {p.ds_tensor.untyped_storage().data_ptr() for p in model.parameters() if hasattr(p, "ds_tensor")}
    if name == "ddp_zero":
        tensors = [t for s in optimizer.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    elif name in ("fsdp2", "fsdp2_reshard"):
        tensors = [local(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    else:
        inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        if name in SHARDED:
            tensors += [m for g in optimizer.param_groups for m in g["params"]]
        elif name in ("zero1", "zero2", "zero2_offload", "two_zero2", "zero2_bf16_masters"):
            tensors += list(optimizer.single_partition_of_fp32_groups)
        elif name in ("zero3", "zero3_offload_param"):
            tensors += list(optimizer.fp32_partitioned_groups_flat)
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
