"""One rank of the ``deepspeed.utils`` accessor runs: safe_get_full_* / safe_set_full_* under stock ZeRO and
ds_tensorshard, one engine per case in one process group.

Usage (per rank, RANK/WORLD_SIZE/MASTER_* set, or under mpiexec): python full_tensor_worker.py OUT CASE [CASE...]
CASE = DTYPE:MODE:STAGE with MODE stock, ts or tsmpi. TinyGPT with a 1,024-token vocabulary: its (tied)
embedding holds more than half the elements, so ds_tensorshard owns it in dim-0 blocks at 2 and 3 ranks.

GAS 2, 3 steps. The getters are read on every rank wherever stock answers (stock fails on some ranks and
leaves the others waiting elsewhere): the fp32 masters from initialize, the step's mean gradients after
the boundary's backward (at stage 1 before it, ``param.grad``), masters and Adam moments after each step.
Setters mid-training: at step 1's boundary one gradient is set, two are scaled
(``safe_update_full_grad_vectorized``) and one master is halved; after step 1 two masters (one split) and
two moments are set and read back. The losses and final parameters then show what the setters did to
training. ds_tensorshard's refusals (TensorAccessError on every rank; the ZeRO-3-only local API's assertion)
are recorded too.
Writes OUT/DTYPE_MODE_STAGE.rankR.pt.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_update_full_grad_vectorized,
)

import ds_tensorshard  # noqa: F401  (registers the plugin)
from ds_tensorshard.errors import TensorAccessError
from tests.helpers.emulated_accelerator import model_device, serve_cases
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, batch, ds_config, param_groups

VOCAB, GAS, STEPS = 1024, 2, 3
SPLIT = "wte.weight"  # tied with head.weight; owned in blocks by ds_tensorshard
MOMENTS = ("exp_avg", "exp_avg_sq")


def setter_values(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """What is set after step 1 (the same on every rank and in every mode): two masters, two moments."""
    gen = torch.Generator().manual_seed(99)

    def like(name: str, scale: float) -> torch.Tensor:
        return torch.rand(shapes[name], generator=gen) * scale

    return {  # masters far from where training has them (about +-0.06), so that their effect shows
        "master:" + SPLIT: like(SPLIT, 0.04) + 0.3,
        "master:blocks.0.proj.weight": like("blocks.0.proj.weight", 0.1) - 0.5,
        "exp_avg:blocks.1.out.weight": like("blocks.1.out.weight", 2e-3) - 1e-3,
        "exp_avg_sq:" + SPLIT: like(SPLIT, 1e-6),
    }


def refusal(call) -> str:
    """The TensorAccessError ``call`` raises (its message), or what else happened."""
    try:
        call()
    except TensorAccessError as err:
        return f"TensorAccessError: {err}"
    except AssertionError as err:
        return f"AssertionError: {err}"
    return "no error"


def run_case(case: str, out_dir: str) -> None:
    dtype, mode, stage = case.split(":")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = ds_config(dtype, mode, int(stage), world)
    if dtype == "fp16":
        config["fp16"]["initial_scale_power"] = 8  # no overflow: every step's gradients are kept
    torch.manual_seed(1234)
    with model_device():
        model = TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    params = dict(engine.module.named_parameters())
    shapes = {n: p.shape for n, p in params.items()}
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    ours = mode != "stock"
    seen: dict[str, dict[str, torch.Tensor]] = {}
    refusals: dict[str, str] = {}

    def read(point: str, kinds: tuple[str, ...]) -> None:
        for name, p in trainable.items():
            for kind in kinds:
                if kind == "master":
                    value = safe_get_full_fp32_param(p)
                elif kind == "grad":
                    value = safe_get_full_grad(p)
                else:
                    value = safe_get_full_optimizer_state(p, kind)
                seen[f"{point} {kind} {name}"] = value.detach().clone()

    read("init", ("master",))
    frozen = [safe_get_full_fp32_param(params["frozen_scale"]), safe_get_full_grad(params["frozen_scale"])]
    if ours:
        refusals["state before step 1"] = refusal(lambda: safe_get_full_optimizer_state(params[SPLIT], "exp_avg"))
    losses, set_read_back = [], {}
    for step in range(STEPS):
        for micro in range(GAS):
            loss = engine(batch(rank, step * GAS + micro).to(engine.device))
            engine.backward(loss)
            losses.append(loss.item())
            point = f"step {step} micro {micro}"
            if micro < GAS - 1 and stage == "1":  # the model's own, local, accumulating gradient
                grads = {n: p for n, p in trainable.items() if p.grad is not None}
                assert all(safe_get_full_grad(p) is p.grad for p in grads.values())
                seen.update({f"{point} local grad {n}": p.grad.detach().float().clone() for n, p in grads.items()})
            elif micro < GAS - 1 and ours:
                refusals["stage 2 gradient before the boundary"] = refusal(lambda: safe_get_full_grad(params[SPLIT]))
            if micro == GAS - 1:
                read(point, ("grad", "master") + (MOMENTS if step > 0 else ()))
                if step == 1:  # setters between backward and step, then what they set
                    blocks0 = params["blocks.0.qkv.weight"]
                    safe_set_full_grad(blocks0, 2.0 * safe_get_full_grad(blocks0))
                    scaled = [params["blocks.1.fc.weight"], params[SPLIT]]
                    safe_update_full_grad_vectorized(scaled, lambda grad, param: 0.5 * grad)
                    halved = params["blocks.1.qkv.weight"]  # the step then starts from the halved master
                    safe_set_full_fp32_param(halved, 0.5 * safe_get_full_fp32_param(halved))
                    read(point + " set", ("grad", "master"))
            engine.step()
        if not ours and step == 0:  # stock links the moments at its first step, before the second group has any
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()  # (stock's own linking, now for every group)
        read(f"after step {step}", ("master",) + MOMENTS)
        if ours and step == 0:
            refusals["gradient after step"] = refusal(lambda: safe_get_full_grad(params[SPLIT]))
            refusals["unknown key"] = refusal(lambda: safe_get_full_optimizer_state(params[SPLIT], "momentum_buffer"))
            refusals["unknown key (set)"] = refusal(
                lambda: safe_set_full_optimizer_state(params[SPLIT], torch.zeros(params[SPLIT].shape), "exp_avgs")
            )
            refusals["wrong shape"] = refusal(lambda: safe_set_full_fp32_param(params[SPLIT], torch.zeros(3, 32)))
            refusals["local getter"] = refusal(lambda: safe_get_local_fp32_param(params[SPLIT]))
            refusals["local state getter"] = refusal(lambda: safe_get_local_optimizer_state(params[SPLIT], "exp_avg"))
            refusals["local grad getter"] = refusal(lambda: safe_get_local_grad(params[SPLIT]))
            refusals["local setter"] = refusal(lambda: safe_set_local_fp32_param(params[SPLIT], params[SPLIT]))
        if step == 1:
            model_before = {n: p.detach().float().clone() for n, p in trainable.items()}
            for target, value in setter_values(shapes).items():
                kind, name = target.split(":")
                if kind == "master":
                    safe_set_full_fp32_param(params[name], value)
                else:
                    safe_set_full_optimizer_state(params[name], value, kind)
            for target, value in setter_values(shapes).items():
                kind, name = target.split(":")
                if kind == "master":
                    set_read_back[target] = torch.equal(safe_get_full_fp32_param(params[name]).cpu(), value)
                else:
                    set_read_back[target] = torch.equal(safe_get_full_optimizer_state(params[name], kind).cpu(), value)
            # as stock: the model's tensors change at the next step only
            model_unchanged = all(torch.equal(p.detach().float(), model_before[n]) for n, p in trainable.items())
    result = {
        "losses": losses,
        "params": {n: p.detach().float().clone() for n, p in params.items()},
        "seen": seen,
        "frozen_is_none": [value is None for value in frozen],
        "refusals": refusals,
        "set_read_back": set_read_back,
        "model_unchanged_by_set": model_unchanged,
        "split": dict(optimizer.plan.split) if ours else {},
        "optimizer_class": type(optimizer).__name__,
    }
    torch.save(result, os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}.pt"))


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    serve_cases(run_case, out_dir, cases)  # EMULATED_CUDA=1: emulated CUDA under NCCL's rules


if __name__ == "__main__":
    main()
