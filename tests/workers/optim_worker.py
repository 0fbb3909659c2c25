"""One rank of an optimizer run: TinyGPT trained with an inner optimizer other than Adam.

python optim_worker.py OUT CASE [CASE...]   CASE = OPTIMIZER:DTYPE:MODE:STAGE[:early], e.g. muon:bf16:ts:2 or
lion:fp32:stock:0 (see optimizers.py; MODE stock, ts or tsmpi, each optionally with ZeRO-Offload
(ts-offload), or ulp: stock with every gradient nudged by one unit in the last place of the model's dtype
before each optimizer step, the reference's own sensitivity to rounding). GAS 2, clipping 1.0 (``early``:
none, and bf16 without its overflow check, so that ZeRO-Offload updates each tensor as its last reduced piece
arrives), WarmupLR, two param groups. Writes OUT/CASE.rankR.pt: losses, grad norms, final parameters,
optimizer-state facts.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.runtime.zero.muon import original_muon

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.transports.torch_comm import close_process_group
from tests.helpers.emulated_accelerator import init_worker, model_device
from tests.helpers.optimizers import setup
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import GAS, SEQ, STEPS, VOCAB, base_mode, batch, ds_config, param_groups


def state_numel(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(t.numel() for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())


GPU_NS_DTYPES = {"gram": torch.float16, "standard": torch.bfloat16}  # ns_compute_dtype where half is supported
_compiled_for: list[bool] = []  # whether the compiled Newton-Schulz graphs were built for half precision


def force_newton_schulz(name: str) -> None:
    """Newton-Schulz's dtype for DeepSpeed's Muon: fp32 for ``muon``, a GPU's half precision for ``muonhalf``.
    The compiled graphs are dropped when the choice changes, so that no case runs another case's graph."""
    half = name == "muonhalf"
    original_muon.ns_compute_dtype = lambda method="gram": GPU_NS_DTYPES[method] if half else torch.float32
    if _compiled_for and _compiled_for[-1] != half:
        torch._dynamo.reset()
    _compiled_for.append(half)


def nudge_gradients_by_one_ulp(model: torch.nn.Module) -> None:
    """After every backward, move each gradient one unit in the last place of its dtype towards +inf: a
    rounding-level change, the kind another summation order makes, made before DeepSpeed reads it."""

    def nudge(param: torch.nn.Parameter) -> None:
        with torch.no_grad():
            param.grad.copy_(torch.nextafter(param.grad, torch.full_like(param.grad, float("inf"))))

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(nudge)


def run_case(case: str, out: str) -> None:
    name, dtype, mode, stage, *variant = case.split(":")
    setup_name = {"adagrad2": "adagrad", "muonhalf": "muon"}.get(name, name)
    if setup_name == "muon":
        force_newton_schulz(name)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = ds_config(dtype, mode, int(stage), world)
    if stage == "0":
        del config["zero_optimization"]
    if variant == ["early"]:
        config["gradient_clipping"] = 0.0
        config["bf16"]["check_grad_overflow"] = False
    torch.manual_seed(1234)
    with model_device():
        model = TinyGPT(vocab=VOCAB, seq=SEQ)
    client = setup(setup_name, model, config)
    # stock ZeRO-1/2 rebuilds Adagrad over one flat group and then fails on a second one (IndexError in
    # get_flat_partition): Adagrad runs with one group; "adagrad2" keeps two, against stage 0
    groups = [{"params": list(model.parameters())}] if name == "adagrad" else param_groups(model)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, config=config, optimizer=client
    )
    if mode == "ulp":
        nudge_gradients_by_one_ulp(engine.module)
    losses, norms = [], []
    for micro in range(STEPS * GAS):
        loss = engine(batch(rank, micro).to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (micro + 1) % GAS == 0:
            norms.append(float(engine.get_global_grad_norm() or 0.0))
    result = {
        "losses": losses,
        "norms": norms,
        "skipped_steps": engine.skipped_steps,
        "optimizer_class": type(optimizer).__name__,
        "state_numel": state_numel(optimizer),
        "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
    }
    if base_mode(mode) in ("ts", "tsmpi"):
        result["inner_class"] = type(optimizer.optimizer).__name__
        result["aux_class"] = type(getattr(optimizer.optimizer, "aux_optimizer", None)).__name__
        result["host_traffic"] = None if optimizer.host is None else vars(optimizer.host.traffic).copy()
        result["device_matrices"] = [p.numel() for p in optimizer.shard.on_device]  # offloaded Muon's
        sections = optimizer.shard.grads.section_of
        result["device_buffers"] = len({id(sections[p]) for p in optimizer.shard.on_device})  # their gradients
        result["first_update_at"] = getattr(optimizer.early, "first_update_at", None)
        result["last_update_at"] = optimizer.last_update_at
        result["split"] = dict(optimizer.plan.split)
        result["numel_per_rank"] = list(optimizer.plan.numel_per_rank)
        result["owned_state_keys"] = sorted({k for s in optimizer.optimizer.state.values() for k in s})
        result["foreign_state"] = sum(
            1 for m in optimizer.optimizer.state if not any(m is x for x in optimizer.shard.masters.values())
        )
    torch.save(result, os.path.join(out, f"{case.replace(':', '_')}.rank{rank}.pt"))


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    init_worker()
    for case in cases:
        run_case(case, out)
    close_process_group()


if __name__ == "__main__":
    main()
