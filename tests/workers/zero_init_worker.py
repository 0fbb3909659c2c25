"""One rank of a ``deepspeed.zero.Init`` equivalence run: builds the model under ``zero.Init`` at
``zero_optimization.stage: 3``, with the tensorshard block (``ts``) and without it (``stock``), then trains it.

Usage (per rank, RANK/WORLD_SIZE/MASTER_* set): python zero_init_worker.py OUT CASE [CASE...]
CASE = MODE[:VARIANT]; MODE ``stock`` or ``ts``; VARIANT a ``+``-joined set of :data:`VARIANTS`:

- (none): ``with deepspeed.zero.Init(config_dict_or_path=config): model = ZeroInitGPT()``; the model's ``__init__``
  re-initializes its weights with ``self.apply`` (as HF's models do), which zero.Init gathers and re-partitions;
- ``modify``: right after construction, ``GatheredParameters(params, modifier_rank=0)``: rank 0 writes new values,
  the other ranks write garbage (stock broadcasts rank 0's on exit);
- ``module``: the model built outside, then ``deepspeed.zero.Init(module=model, config_dict_or_path=config)``;
- ``remote``: ``zero.Init(remote_device="cpu", pin_memory=True, ...)``;
- ``nested``: the model built in a ``zero.Init`` inside another, the inner one given the config as a JSON file's path;
- ``external``: the model's ``lm_scale`` module reads the embedding's weight in its forward, registered with
  ``deepspeed.zero.register_external_parameter`` in ``__init__``;
- ``bf16``: the bf16 config (zero.Init builds the parameters in bf16);
- ``api``: the ``external`` model, its reader not registered in ``__init__``; right after construction
  ``GatheredParameters([wte.weight], modifier_rank=0, fwd_module=reader)`` (rank 0 halves the embedding, the others
  write -1; the reader's external parameters recorded: ``fwd_module``); at every accumulation boundary, between
  backward and step, ``safe_update_full_grad_vectorized`` scales three gradients (``vectorized``: them before and
  after, at the first boundary); after training an ``eval()`` + ``no_grad()`` forward, then
  ``engine.empty_partition_cache()`` (``emptied``: the parameters gathered before it and after, what each rank
  holds after);
- ``mixed`` (``ts`` only): built under ``zero.Init`` without the block, then ``deepspeed.initialize`` with it: the
  refusal's message is recorded (``refused``), nothing trains.

Writes OUT/CASE.rankR.pt (``:`` and ``+`` as ``_``): what each rank holds right after construction (``built``), every
parameter gathered with ``GatheredParameters`` right after it (``initial``), after the write (``modified``), the
training's losses and norms (stage3_worker's ``train``), and the parameters gathered after it (``params``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import safe_get_full_grad, safe_update_full_grad_vectorized
from torch import nn

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.errors import TensorShardConfigError
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.emulated_accelerator import init_worker, model_device
from tests.workers.stage3_worker import Stage3GPT, batch, ds_config, gathered, holdings, train

VARIANTS = ("modify", "module", "remote", "nested", "external", "bf16", "api", "mixed")
SCALED = {"blocks.0.qkv.weight": 0.5, "wte.weight": 3.0, "blocks.1.fc.bias": -2.0}  # api: gradient factors
MODES = ("stock", "ts")


class ZeroInitGPT(Stage3GPT):
    """stage3_worker's model, its weights re-initialized by ``self.apply`` at the end of ``__init__`` (HF's
    ``post_init``); with ``external``, a :class:`Reader` of the embedding's weight (a parameter of another module),
    registered as its external parameter."""

    def __init__(self, external: bool = False, register: bool = True) -> None:
        super().__init__(set())
        self.apply(_init_weights)
        self.reader = Reader(self.wte, register) if external else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = super().forward(tokens)
        return loss if self.reader is None else loss + self.reader()


class Reader(nn.Module):
    """A module whose forward reads another module's weight (held outside its submodules, as a tied head may)."""

    def __init__(self, embedding: nn.Embedding, register: bool = True) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((getattr(embedding.weight, "ds_shape", embedding.weight.shape)[1],), 1e-3))
        self.source = [embedding]  # not a submodule
        if register:
            deepspeed.zero.register_external_parameter(self, embedding.weight)

    def forward(self) -> torch.Tensor:
        return (self.source[0].weight[:4] * self.scale).sum()


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def parse(case: str) -> tuple[str, set[str]]:
    mode, *variant = case.split(":")
    flags = set(variant[0].split("+")) if variant else set()
    assert mode in MODES and flags <= set(VARIANTS), case
    return mode, flags


def param_groups(model: nn.Module) -> list[dict]:
    """Decay for the matrices (by ``ds_shape``: a partitioned parameter's ``.data`` is empty), none for the rest."""
    named = list(model.named_parameters())
    decay = [p for _, p in named if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for _, p in named if len(getattr(p, "ds_shape", p.shape)) < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def build(flags: set[str], config: dict) -> nn.Module:
    """The model, built under ``zero.Init`` as the variant says."""
    torch.manual_seed(1234)
    external, register = bool(flags & {"external", "api"}), "api" not in flags
    if "module" in flags:
        with model_device():  # emulated CUDA: built on the device (a CPU parameter's data cannot move there)
            model = ZeroInitGPT(external, register)
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
        return model
    kwargs: dict = {"remote_device": "cpu", "pin_memory": True} if "remote" in flags else {}
    with deepspeed.zero.Init(config_dict_or_path=config, **kwargs):
        nested = "nested" in flags
        with deepspeed.zero.Init(config_dict_or_path=as_file(config)) if nested else contextlib.nullcontext():
            return ZeroInitGPT(external, register)


def surface(model: nn.Module) -> dict[str, tuple]:
    """What the frameworks read of each parameter: ``ds_shape``, ``ds_numel``, ``ds_status``, ``ds_persist``,
    ``ds_id`` (from the model's first), ``is_external_param``, how many modules use it now, and ``.shape``."""
    named = dict(model.named_parameters())
    first = min(p.ds_id for p in named.values())
    return {
        name: (
            tuple(p.ds_shape),
            p.ds_numel,
            p.ds_status.name,
            p.ds_persist,
            p.ds_id - first,
            p.is_external_param,
            len(p.ds_active_sub_modules),
            tuple(p.shape),
        )
        for name, p in named.items()
    }


def as_file(config: dict) -> str:
    """``config`` written to a JSON file of its own; its path."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    return f.name


@torch.no_grad()
def modify(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """``GatheredParameters(modifier_rank=0)``: rank 0 halves every parameter and adds 0.01, the others write -1;
    returns what rank 0 wrote (fp32 CPU)."""
    named = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=0):
        for param in named.values():
            if rank == 0:
                param.mul_(0.5).add_(0.01)
            else:
                param.fill_(-1.0)
        return {n: p.detach().float().cpu().clone() for n, p in named.items()} if rank == 0 else {}


@torch.no_grad()
def write_through_fwd_module(model: ZeroInitGPT, rank: int) -> list[int]:
    """``GatheredParameters([wte.weight], modifier_rank=0, fwd_module=model.reader)``: rank 0 halves the embedding,
    the others write -1; the reader's external parameters afterwards (``ds_id`` from the model's first)."""
    weight, reader = model.wte.weight, model.reader
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0, fwd_module=reader):
        weight.mul_(0.5) if rank == 0 else weight.fill_(-1.0)
    first = min(p.ds_id for p in model.parameters())
    return sorted(p.ds_id - first for p in getattr(reader, "_external_params", {}).values())


def scale_gradients_at_boundaries(engine, record: dict) -> None:
    """Before each boundary's ``engine.step()``, ``safe_update_full_grad_vectorized`` multiplies the gradients of
    :data:`SCALED` by their factors; the first time, each one's full gradient before and after goes to ``record``."""
    named = dict(engine.module.named_parameters())
    params, step = [named[n] for n in SCALED], engine.step
    factor = {named[n]: f for n, f in SCALED.items()}

    def stepping() -> None:
        if engine.is_gradient_accumulation_boundary():
            first = not record
            if first:
                record.update({f"before {n}": safe_get_full_grad(named[n]).detach().cpu().clone() for n in SCALED})
            safe_update_full_grad_vectorized(params, lambda grad, param: grad * factor[param])
            if first:
                record.update({f"after {n}": safe_get_full_grad(named[n]).detach().cpu().clone() for n in SCALED})
        step()

    engine.step = stepping


def empty_cache(engine, rank: int) -> dict:
    """An ``eval()`` + ``no_grad()`` forward, then ``engine.empty_partition_cache()``: the parameters gathered
    (``ds_status`` AVAILABLE) before it and after, and what this rank holds after."""
    engine.eval()
    with torch.no_grad():
        engine(batch(rank, 999).to(engine.device))
    params = list(engine.module.parameters())
    before = sum(p.ds_status is ZeroParamStatus.AVAILABLE for p in params)
    engine.empty_partition_cache()
    after = sum(p.ds_status is ZeroParamStatus.AVAILABLE for p in params)
    engine.train()
    return {"available_before": before, "available_after": after, "held_after": holdings(engine.module)["held_numel"]}


def run_case(case: str, out_dir: str) -> None:
    mode, flags = parse(case)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = ds_config("bf16" if "bf16" in flags else "fp32", mode, {"persist0"}, world)
    name = os.path.join(out_dir, f"{case.replace(':', '_').replace('+', '_')}.rank{rank}.pt")
    if "mixed" in flags:
        model = build(flags, ds_config("fp32", "stock", {"persist0"}, world))
        try:
            deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
        except TensorShardConfigError as err:
            torch.save({"refused": str(err)}, name)
        return
    model = build(flags, config)
    result: dict = {"built": holdings(model), "initial": gathered(model)}
    result["built_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    result["owned"] = sum(getattr(p, "ts_owned", None) is not None for p in model.parameters())
    result["surface"] = surface(model)
    if "modify" in flags:
        result["written"] = modify(model, rank)
        result["modified"] = gathered(model)
    if "api" in flags:
        result["fwd_module"] = write_through_fwd_module(model, rank)
        result["modified"] = gathered(model)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    result["vectorized"] = {}
    if "api" in flags:
        scale_gradients_at_boundaries(engine, result["vectorized"])
    result.update(train(engine, set(), rank))
    if "api" in flags:
        result["emptied"] = empty_cache(engine, rank)
    result.update(
        params=gathered(engine.module),
        skipped_steps=engine.skipped_steps,
        optimizer_class=type(optimizer).__name__,
        group_lrs=[g["lr"] for g in optimizer.param_groups],
    )
    torch.save(result, name)
    engine.destroy()


def main() -> None:
    out_dir, *cases = sys.argv[1:]
    init_worker()
    get_accelerator().is_fp16_supported = lambda: True  # as stage3_worker
    for case in cases:
        run_case(case, out_dir)
    close_process_group()


if __name__ == "__main__":
    main()
