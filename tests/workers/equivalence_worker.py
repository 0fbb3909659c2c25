"""One rank of an equivalence run: trains TinyGPT under several configs in one process group.

Usage (per rank, with RANK/WORLD_SIZE/MASTER_* set): python equivalence_worker.py OUT CASE [CASE...]
CASE = DTYPE:MODE:STAGE[:SPLIT], e.g. fp32:stock:2, bf16:ts:1 or fp32:ts:2:never. MODE ``ts`` enables
ds_tensorshard, ``tsmpi`` with the mpi comm backend; a MODE ending in ``-offload`` (``stock-offload``,
``ts-offload``, ``tsmpi-offload``) adds ZeRO-Offload (``offload_optimizer`` device cpu, pin_memory, as the HF
guide's config); SPLIT is ``tensorshard.split_tensors``.
``EQ_VOCAB`` (default 64) sets the vocabulary: 1024 gives an embedding larger than a rank's share
at 4 ranks and more, so ``"auto"`` splits it.
Writes OUT/CASE.rankR.pt with the per-micro-step losses, grad norms, final parameters and
optimizer-state facts.
"""

from __future__ import annotations

import math
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

import ds_tensorshard  # noqa: F401  (registers the plugin)
from tests.helpers.emulated_accelerator import model_device, serve_cases
from tests.helpers.tiny_gpt import TinyGPT

MICRO_BATCH, GAS, STEPS, SEQ = 2, 2, 5, 16
CASES = [f"{d}:{m}:{s}" for d in ("fp32", "bf16", "fp16") for m in ("stock", "ts") for s in (1, 2)]  # all of them
# ZeRO-Offload against stock's: the default tier's pairs (each stage once, each dtype once), then the rest
OFFLOAD_CASES = [f"{d}:{m}-offload:{s}" for d, s in (("fp32", 1), ("bf16", 2)) for m in ("stock", "ts")]
OFFLOAD_EXTENDED = [f"{d}:{m}-offload:{s}" for d, s in (("fp32", 2), ("bf16", 1)) for m in ("stock", "ts")]
# bucket_layout "stripes" (one reduce-scatter and one all-gather per bucket) against stock: each stage once
STRIPE_CASES = ["fp32:ts-stripes:2", "bf16:ts-stripes:1"]
# bucket_layout "flat" (a flat plan, the parameters views of one storage gathered in place) against stock
FLAT_CASES = ["fp32:ts-flat:2", "bf16:ts-flat:1", "fp16:ts-flat:2"]
VOCAB = int(os.environ.get("EQ_VOCAB", "64"))
OFFLOAD, STRIPES, FLAT = "-offload", "-stripes", "-flat"


def base_mode(mode: str) -> str:
    """``ts-offload``, ``ts-stripes`` or ``ts-flat`` -> ``ts``: the mode without ZeRO-Offload or its layout."""
    return mode.removesuffix(OFFLOAD).removesuffix(STRIPES).removesuffix(FLAT)


def ds_config(dtype: str, mode: str, stage: int, world: int, split: str = "auto") -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO_BATCH * GAS * world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": [0.0, 0.0], "warmup_max_lr": [1e-2, 5e-3], "warmup_num_steps": 3},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "steps_per_print": 1000,
    }
    if mode.endswith(OFFLOAD):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    layout = mode.removesuffix(OFFLOAD).rsplit("-", 1)[-1] if mode.count("-") > mode.endswith(OFFLOAD) else "windows"
    mode = base_mode(mode)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        # 2**20 overflows the first fp16 steps: they must be skipped, with the scheduler.
        config["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1000, "hysteresis": 1}
    if mode in ("ts", "tsmpi"):
        config["tensorshard"] = {
            "enabled": True,
            "comm_backend": "mpi" if mode == "tsmpi" else "torch",
            "split_tensors": split,
            "bucket_layout": layout,
        }
    return config


def param_groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # includes the frozen parameter
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(rank: int, micro_step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * micro_step + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)


def run_case(case: str, out_dir: str) -> None:
    dtype, mode, stage, *split = case.split(":")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(1234)
    with model_device():
        model = TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=ds_config(dtype, mode, int(stage), world, *split)
    )
    unused_initial = engine.module.unused.detach().float().clone()
    losses, norms, grads_after_backward, started_at_embedding = [], [], [], []
    ours = base_mode(mode) in ("ts", "tsmpi")
    if ours:  # how many buckets were under way when backward reached the embedding (its end)

        def on_embedding(module, inputs, out) -> None:
            out.register_hook(lambda grad: started_at_embedding.append(optimizer.reducer.started))

        engine.module.wte.register_forward_hook(on_embedding)
    for micro in range(STEPS * GAS):
        loss = engine(batch(rank, micro).to(engine.device))
        engine.backward(loss)
        grads_after_backward.append(sum(1 for p in engine.module.parameters() if p.grad is not None))
        engine.step()
        losses.append(loss.item())
        if (micro + 1) % GAS == 0:
            norms.append(float(engine.get_global_grad_norm() or 0.0))
    result = {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        "unused_initial": unused_initial,
        "skipped_steps": engine.skipped_steps,
        "grads_after_backward": grads_after_backward,
        "optimizer_class": type(optimizer).__name__,
        "inner_class": type(optimizer.optimizer).__name__,
    }
    if ours:
        plan = optimizer.plan
        state_tensors = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        result.update(
            {
                "numel_per_rank": list(plan.numel_per_rank),
                "blocks": {name: [(b.rank, b.start, b.stop) for b in blocks] for name, blocks in plan.blocks.items()},
                "state_numel": sum(t.numel() for t in state_tensors),
                "master_numel": sum(m.numel() for g in optimizer.param_groups for m in g["params"]),
                "group_lrs": [g["lr"] for g in optimizer.param_groups],
                "steps": sorted({int(s["step"]) for s in optimizer.optimizer.state.values()}),
                "started_at_embedding": started_at_embedding,
                "buckets": len(optimizer.buckets),
                "slots": [b.slot for b in optimizer.buckets],
                "routes": [list(b.by_all_reduce) for b in optimizer.buckets],
                "largest_buffer": max(b.numel for b in optimizer.buckets),
                "layout": optimizer.layout.layout,
                "in_flat_storage": in_flat_storage(optimizer),
                "flat_by_all_reduce": getattr(optimizer.domains["data_parallel"].flat, "by_all_reduce", None),
                "flat_shared": getattr(optimizer.domains["data_parallel"].flat, "lane", None) is not None,
                "first_embedding_bucket": next(
                    i for i, b in enumerate(optimizer.buckets) if any(p is engine.module.wte.weight for p in b.params)
                ),
                "state_devices": sorted({str(t.device) for t in state_tensors}),
                "master_devices": sorted({str(m.device) for g in optimizer.param_groups for m in g["params"]}),
                "host_traffic": None if optimizer.host is None else vars(optimizer.host.traffic).copy(),
                "last_update_at": optimizer.last_update_at,
                "masters_pinned": get_accelerator().device_name() != "cpu"
                and all(m.is_pinned() for g in optimizer.param_groups for m in g["params"]),
            }
        )
    torch.save(result, os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}.pt"))


def in_flat_storage(optimizer) -> int:
    """How many trained parameters are views of the flat parameter storage, at their plan offsets (0: none)."""
    flat = optimizer.domains["data_parallel"].flat
    if flat is None:
        return 0
    base, size = flat.storage.data_ptr(), flat.storage.element_size()
    return sum(p.data_ptr() == base + optimizer.plan.flat_offsets[optimizer.names[p]] * size for p in optimizer.params)


def stripes_by_all_reduce() -> None:
    """``EQ_STRIPES_BY_ALL_REDUCE=1``: every stripe reduced and gathered by all-reduce, whatever the wire (on an
    accelerator the cost model takes that route only from 8 ranks)."""
    from ds_tensorshard.datapath import defaults

    defaults.LayoutChoice.routes = lambda self, n: defaults.StripeRoutes(math.inf, math.inf)


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    if os.environ.get("EQ_STRIPES_BY_ALL_REDUCE") == "1":
        stripes_by_all_reduce()
    serve_cases(run_case, out_dir, cases)  # EMULATED_CUDA=1: emulated CUDA under NCCL's rules


if __name__ == "__main__":
    main()
