"""One rank of a ZeRO-3 equivalence run: trains a TinyGPT-like model at ``zero_optimization.stage: 3`` under
several configs in one process group.

Usage (per rank, RANK/WORLD_SIZE/MASTER_* set, or under mpiexec): python stage3_worker.py OUT CASE [CASE...]
CASE = DTYPE:MODE[:VARIANT]. MODE: ``stock`` (stock ZeRO-3), ``ts`` (the tensorshard block, torch transport),
``tsmpi`` (mpi transport), or ``stock2`` (stock ZeRO-2, the harness's own check). VARIANT: ``+``-joined flags of
:data:`FLAGS`, e.g. ``fp32:ts:persist0+twice``. With no flag, ``stage3_param_persistence_threshold`` keeps its
default (1e5): the embedding (tied to the head) and each block's ``fc``/``out`` are above it, gathered per module;
the other tensors persist on every rank. ``persist0`` sets it to 0 and keeps stock's fetch knobs: on this small
model the first fetch of a forward prefetches the whole model, kept until backward is done. Every other flag (the
hard cases) sets the threshold to 0, ``stage3_prefetch_bucket_size`` and ``stage3_max_reuse_distance`` to 0: each
module's parameters are gathered for its forward and released after it, gathered again for its backward and for a
checkpointed recompute (stock, 2 ranks: 68 gathers per step instead of 4; with ``ckpt`` 88, ``twice`` 92).
Writes OUT/CASE.rankR.pt (``:`` and ``+`` as ``_``): per-micro-step losses, per-step global grad norms, every
parameter gathered with ``deepspeed.zero.GatheredParameters`` before and after training, and what each rank holds.
"""

from __future__ import annotations

import os
import sys
import time

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module
from torch import nn

import ds_tensorshard  # noqa: F401  (registers the plugin)
from tests.helpers.emulated_accelerator import model_device, serve_cases
from tests.helpers.tiny_gpt import Block, TinyGPT, checkpointed
from tests.workers.equivalence_worker import param_groups

MICRO_BATCH, GAS, STEPS, SEQ = 2, 2, 3, 16
# width 160: fc/out 102,400 elements and the 1,024-word embedding 163,840, above the default threshold (1e5);
# qkv 76,800, proj 25,600, biases and norms below it
VOCAB, WIDTH = 1024, 160
# persist0: threshold 0; twice: the last block called twice per forward; root: a trained parameter of the root
# read in its forward; ckpt/dsckpt: every block under torch's checkpoint (use_reentrant=False) or DeepSpeed's;
# evalnograd: an eval() + no_grad() forward after each step; nosync: engine.no_sync() on the first micro-step;
# offopt/offparam: ZeRO-Offload of the optimizer / of the parameters (device cpu, pinned), as HF's zero3_offload.json;
# zerograd: the optimizer's zero_grad() between the micro-steps of each step (as Lightning calls it after a resume);
# stepgrad: the optimizer's zero_grad() after the backward of each step's last micro-step, before engine.step();
# branch: two modules run only in some micro-steps (:func:`branches`); frozenleaf: a ZeRO-3 leaf module
# (deepspeed.utils.set_z3_leaf_modules) whose parameters are all frozen, after the blocks;
# tiled: each block's MLP through DeepSpeed's TiledMLP, 2 shards (its backward runs once per shard, marking the
# MLP's parameters ds_grad_is_ready False for the first); coalesce: each step's GAS backwards in one
# engine.coalesce_grad_reduction() block (gradient_accumulation_steps 1, the boundary set on the last), one step();
# repeat: the last micro-step's forward and backward run again before engine.step() (stock ZeRO-3 adds the second
# backward's gradients: its micro_step_id); unmanaged: managed_gradient_accumulation false, engine.step() called
# after each step's last micro-step only (the boundary)
FLAGS = ("persist0", "twice", "root", "ckpt", "dsckpt", "evalnograd", "nosync", "offopt", "offparam", "zerograd")
FLAGS += ("stepgrad", "branch", "frozenleaf", "tiled", "coalesce", "repeat", "unmanaged")
OFFLOAD_FLAGS = {"offopt", "offparam"}
MODES = ("stock", "stock2", "ts", "tsmpi")
CHECKPOINT = {"ckpt": "non_reentrant", "dsckpt": "deepspeed"}


class FrozenLeaf(nn.Module):
    """Two linear layers gathered as one ZeRO-3 leaf module (``set_z3_leaf_modules``), every parameter frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Stage3GPT(TinyGPT):
    """TinyGPT with the hard cases of ZeRO-3 on request (``flags``: see :data:`FLAGS`)."""

    def __init__(self, flags: set[str]) -> None:
        how = next((CHECKPOINT[f] for f in flags if f in CHECKPOINT), None)
        super().__init__(vocab=VOCAB, width=WIDTH, seq=SEQ, checkpointing=how)
        self.twice, self.tiled = "twice" in flags, "tiled" in flags
        self.root_shift = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02) if "root" in flags else None
        self.early_branch = nn.Linear(WIDTH, WIDTH) if "branch" in flags else None
        self.late_branch = nn.Linear(WIDTH, WIDTH) if "branch" in flags else None
        self.branches: set[str] = set()  # those of the branches the next forward runs (set by :func:`train`)
        self.frozen_leaf = FrozenLeaf() if "frozenleaf" in flags else None
        if self.frozen_leaf is not None:
            set_z3_leaf_modules(self, [FrozenLeaf])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos) + self.frozen_scale
        if self.root_shift is not None:  # read by the root's forward, outside any submodule
            x = x + self.root_shift[: tokens.shape[1]]
        blocks = [*self.blocks, self.blocks[-1]] if self.twice else list(self.blocks)
        for block in blocks:
            if self.tiled:
                x = tiled(block, x)
            else:
                x = block(x) if self.checkpointing is None else checkpointed(block, x, self.checkpointing)
        for name in sorted(self.branches):
            x = x + getattr(self, f"{name}_branch")(x)
        if self.frozen_leaf is not None:
            x = x + self.frozen_leaf(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )


def tiled(block: Block, x: torch.Tensor) -> torch.Tensor:
    """``block(x)``, its MLP computed by DeepSpeed's ``TiledMLP`` in 2 shards of the sequence."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # only this flag needs it

    x = block.attend(x)
    params = [p for module in (block.ln2, block.fc, block.out) for p in module.parameters()]
    return x + TiledMLP.apply(Block.mlp, block, x, 2, params)


def parse(case: str) -> tuple[str, str, set[str]]:
    dtype, mode, *variant = case.split(":")
    flags = set(variant[0].split("+")) if variant else set()
    assert dtype in ("fp32", "bf16", "fp16") and mode in MODES and flags <= set(FLAGS), case
    return dtype, mode, flags


def ds_config(dtype: str, mode: str, flags: set[str], world: int) -> dict:
    zero: dict = {"stage": 2 if mode == "stock2" else 3, "reduce_bucket_size": 200_000}
    if flags - OFFLOAD_FLAGS:
        zero["stage3_param_persistence_threshold"] = 0
    if flags - {"persist0", *OFFLOAD_FLAGS}:  # gathered per module, released after use
        zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    if "offopt" in flags:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if "offparam" in flags:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO_BATCH * GAS * world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            # a floor above 0: WarmupLR's first two steps run at warmup_min_lr (with 0, nothing would train)
            "params": {"warmup_min_lr": [2e-3, 1e-3], "warmup_max_lr": [1e-2, 5e-3], "warmup_num_steps": 3},
        },
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":  # 2**20 overflows the first step: skipped, with the scheduler
        config["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1000, "hysteresis": 1}
    if "unmanaged" in flags:
        config["managed_gradient_accumulation"] = False
    if "coalesce" in flags:  # the block's backwards are one step's; the boundary is set on its last
        config.update(gradient_accumulation_steps=1, train_batch_size=MICRO_BATCH * world)
    if mode in ("ts", "tsmpi"):
        config["tensorshard"] = {"enabled": True, "comm_backend": "mpi" if mode == "tsmpi" else "torch"}
    return config


def branches(micro: int) -> set[str]:
    """The branches a micro-step runs: ``early`` in the first micro-step of every step but the last (in the last
    step none of its parameters gets a gradient), ``late`` in the last micro-step of every step."""
    ran = {"late"} if micro % GAS == GAS - 1 else set()
    return ran | {"early"} if micro % GAS == 0 and micro < (STEPS - 1) * GAS else ran


def batch(rank: int, micro_step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * micro_step + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)


def holdings(module: nn.Module) -> dict:
    """What this rank holds of the parameters now: elements of ``p.data``, of ``p.ds_tensor`` (per parameter in
    ``pieces``), of the two's memory counted once (a view of the other, or of one flat buffer, is not counted
    twice), and the model's size (``ds_numel``: a parameter not resident here has ``p.data`` of shape (0,))."""
    named = dict(module.named_parameters())  # tied head.weight is wte.weight: once
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size())
        for p in named.values()
        for t in (p.data, getattr(p, "ds_tensor", None))
        if t is not None and t.numel()
    )
    held, end = 0, 0
    for start, stop, size in spans:
        held += max(0, stop - max(start, end)) // size
        end = max(end, stop)
    pieces = {n: p.ds_tensor.numel() for n, p in named.items() if hasattr(p, "ds_tensor")}
    return {
        "data_numel": sum(p.data.numel() for p in named.values()),
        "ds_tensor_numel": sum(pieces.values()),
        "held_numel": held,
        "model_numel": sum(getattr(p, "ds_numel", p.numel()) for p in named.values()),
        "pieces": pieces,
        "shapes": {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in named.items()},
        "persistent": sorted(n for n, p in named.items() if getattr(p, "ds_persist", False)),
        "homes": {n: p.ds_tensor.device.type for n, p in named.items() if hasattr(p, "ds_tensor")},
        # ds_tensorshard's batches gathered so far, by route (broadcasts, all_reduce, all_gather)
        "routes": [layout.route for layout in _owned(named.values())._layouts.values()]
        if _owned(named.values())
        else [],
    }


def _owned(params) -> object | None:
    """ds_tensorshard's parameter protocol of the model (None for stock's)."""
    return next((p.ts_owned for p in params if getattr(p, "ts_owned", None) is not None), None)


def train(engine, flags: set[str], rank: int) -> dict:
    """GAS micro-steps per step (``nosync``: the first under ``engine.no_sync()``, its refusal recorded;
    ``zerograd``: the optimizer's ``zero_grad()`` before the forward of each step's last micro-step; ``stepgrad``:
    after its backward, before ``engine.step()``; ``branch``: the model runs :func:`branches`)."""
    losses, norms, eval_losses, refused, resident = [], [], [], None, 0
    averaged: dict = {}
    for micro in range(STEPS * GAS):
        tokens = batch(rank, micro).to(engine.device)
        if "zerograd" in flags and (micro + 1) % GAS == 0:
            engine.optimizer.zero_grad()
        if "branch" in flags:
            engine.module.branches = branches(micro)
        if "nosync" in flags and micro % GAS == 0 and refused is None:
            try:
                with engine.no_sync():
                    loss = engine(tokens)
                    engine.backward(loss)
            except AssertionError as err:  # stock ZeRO-3 refuses no_sync on entry: then train without it
                refused = str(err)
                loss = engine(tokens)
                engine.backward(loss)
        else:
            loss = engine(tokens)
            resident = sum(
                getattr(p, "ds_status", None) is ZeroParamStatus.AVAILABLE for p in engine.module.parameters()
            )
            engine.backward(loss)
        if "repeat" in flags and (micro + 1) % GAS == 0:
            engine.backward(engine(tokens))
        if micro == GAS - 1 and engine.zero_optimization_stage() == 3:
            averaged = averaged_parts(engine)
        if "stepgrad" in flags and (micro + 1) % GAS == 0:
            engine.optimizer.zero_grad()
        if "unmanaged" not in flags or (micro + 1) % GAS == 0:
            engine.step()
        losses.append(loss.item())
        if (micro + 1) % GAS == 0:
            norms.append(float(engine.get_global_grad_norm() or 0.0))
            if "evalnograd" in flags:
                engine.eval()
                with torch.no_grad():
                    eval_losses.append(engine(batch(rank, 999).to(engine.device)).item())
                engine.train()
    return {
        "losses": losses,
        "norms": norms,
        "eval_losses": eval_losses,
        "no_sync_refused": refused,
        "resident_after_forward": resident,  # the last micro-step's, between its forward and backward
        "averaged": averaged,
    }


def averaged_parts(engine) -> dict:
    """The first step's ``optimizer.averaged_gradients`` before ``step()``, as stock's stage-3 tests read it: per
    group, per parameter (by name) this rank's part and, for ds_tensorshard's, the blocks it owns."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = engine.optimizer.fp16_groups
    return {
        index: [
            (names[id(p)], grad.detach().float().cpu().clone(), [(b.rank, b.start, b.stop) for b in blocks_of(p)])
            for p, grad in zip(groups[index], parts)
        ]
        for index, parts in engine.optimizer.averaged_gradients.items()
    }


def blocks_of(param) -> list:
    """ds_tensorshard's blocks of ``param`` (none for stock's)."""
    return getattr(param, "ts_blocks", [])


def train_coalesced(engine, rank: int) -> dict:
    """``coalesce``: each step's GAS backwards in one ``engine.coalesce_grad_reduction()`` block, the boundary set
    on the last, then one ``step()`` (as DeepSpeed's own tests of the block)."""
    losses, norms = [], []
    for step in range(STEPS):
        with engine.coalesce_grad_reduction():
            for g in range(GAS):
                loss = engine(batch(rank, step * GAS + g).to(engine.device))
                engine.set_gradient_accumulation_boundary(g == GAS - 1)
                engine.backward(loss)
                losses.append(loss.item())
        engine.step()
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    return {"losses": losses, "norms": norms, "eval_losses": [], "no_sync_refused": None, "resident_after_forward": 0}


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as users read it at ZeRO-3: inside ``GatheredParameters`` over all of them, fp32 CPU."""
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


def run_case(case: str, out_dir: str) -> None:
    dtype, mode, flags = parse(case)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    started = time.monotonic()
    torch.manual_seed(1234)
    with model_device():
        model = Stage3GPT(flags)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=ds_config(dtype, mode, flags, world)
    )
    built, initial = holdings(engine.module), gathered(engine.module)
    result = train_coalesced(engine, rank) if "coalesce" in flags else train(engine, flags, rank)
    result.update(
        built=built,
        trained=holdings(engine.module),
        params=gathered(engine.module),
        initial=initial,
        skipped_steps=engine.skipped_steps,
        optimizer_class=type(optimizer).__name__,
        leaf_modules=[n for n, m in engine.module.named_modules() if z3_leaf_module(m)],
        group_lrs=[g["lr"] for g in optimizer.param_groups],
        launcher="deepspeed" if "CROSS_RANK" in os.environ else "mpi" if "PMI_RANK" in os.environ else "ranks",
        seconds=time.monotonic() - started,  # for the record (docs), never asserted
    )
    name = case.replace(":", "_").replace("+", "_")
    torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
    engine.destroy()


def main() -> None:
    out_dir, *cases = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]  # the deepspeed launcher's
    serve_cases(run_case, out_dir, cases)  # EMULATED_CUDA=1: emulated CUDA under NCCL's rules


if __name__ == "__main__":
    main()
