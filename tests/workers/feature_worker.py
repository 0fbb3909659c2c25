"""One rank of the fidelity runs: DeepSpeed features trained with stock ZeRO and with ds_tensorshard.

Usage (per rank, RANK/WORLD_SIZE/MASTER_* set, or under mpiexec): python feature_worker.py OUT CASE [CASE...]
CASE = SCENARIO:MODE with MODE stock, ts or tsmpi; SCENARIO from :data:`SCENARIOS` (run at 3 ranks) or
:data:`TWO_RANK` (DeepSpeed 0.17-0.19 keys and PyTorch-style backward, run at 2 ranks). Writes
OUT/SCENARIO_MODE.rankR.pt with per-micro-step losses, per-step grad norms and loss scales, skipped steps and
the final parameters.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch

import ds_tensorshard  # noqa: F401  (registers the plugin)
from tests.helpers.emulated_accelerator import model_device, serve_cases
from tests.helpers.tiny_gpt import CHECKPOINTING, TinyGPT
from tests.workers.equivalence_worker import MICRO_BATCH, SEQ, VOCAB, batch, ds_config, param_groups

# scenario -> (dtype, stage, gradient accumulation steps, optimizer steps, top-level keys, zero_optimization keys)
SCENARIOS = {
    "no_sync_stage1": ("fp32", 1, 1, 4, {}, {}),
    "fp16_stage1_scale": (
        "fp16",
        1,
        2,
        32,
        {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 1}},
        {},
    ),
    "bf16_comm_fp32": ("bf16", 2, 2, 5, {"communication_data_type": "fp32"}, {}),
    "bf16_accum_fp32_stage1": ("bf16", 1, 3, 5, {"data_types": {"grad_accum_dtype": "fp32"}}, {}),
    "zero_numel": ("fp32", 2, 2, 5, {}, {}),
    "predivide_stage1": ("fp32", 1, 2, 5, {"gradient_predivide_factor": 2.0}, {"reduce_scatter": False}),
    "predivide_stage2": ("fp32", 2, 2, 5, {"gradient_predivide_factor": 2.0}, {"reduce_scatter": False}),
    "prescale_stage1": ("fp32", 1, 2, 5, {"prescale_gradients": True}, {}),
    "no_reduce_scatter_stage2": ("fp32", 2, 2, 5, {}, {"reduce_scatter": False}),
    "no_contiguous_stage2": ("fp32", 2, 2, 5, {}, {"contiguous_gradients": False}),
    # a second backward in a step's first micro-step (no boundary): the two add up, as in stock
    "two_backwards_stage1": ("fp32", 1, 2, 4, {}, {}),
    "two_backwards_stage2": ("fp32", 2, 2, 4, {}, {}),
}
# scenario -> how TinyGPT's blocks are checkpointed (tests/helpers/tiny_gpt.py): each block's parameters once
CHECKPOINTED = {f"checkpoint_{how}_stage{stage}": how for how in CHECKPOINTING for stage in (1, 2)}
# scenario -> the backend of engine.compile() (torch.compile of the module; stock compiled the same way).
# aot_eager runs AOTAutograd's forward and backward graphs with eager kernels; inductor, the CPU default,
# generates and builds C++ kernels, minutes of CPU at 3 ranks on 2 cores: those scenarios are in EXTENDED
COMPILED = {f"compile_{backend}_stage{stage}": backend for backend in ("aot_eager", "inductor") for stage in (1, 2)}
EXTENDED = {name for name, backend in COMPILED.items() if backend == "inductor"}  # test_fidelity: -m extended
SCENARIOS.update({name: ("fp32", int(name[-1]), 2, 4, {}, {}) for name in CHECKPOINTED})
SCENARIOS.update({name: ("fp32", int(name[-1]), 2, 3, {}, {}) for name in COMPILED})
SUM = {"gradient_allreduce_op": "sum"}
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bf16"}}
# the same columns; torch_autocast last: once any engine of a process enabled it, stock ZeRO sends every later
# engine's gradients in the dtypes of DeepSpeed's autocast marks (a process-wide flag), and so does ds_tensorshard
TWO_RANK = {
    **{f"torch_backward_{d}_stage{s}": (d, s, 2, 5, {}, {}) for d in ("fp32", "bf16") for s in (1, 2)},
    "torch_backward_fp16_stage2": ("fp16", 2, 2, 5, {}, {}),
    "allreduce_sum_stage1": ("fp32", 1, 2, 5, SUM, {"reduce_scatter": False}),
    "allreduce_sum_stage2_predivide": ("fp32", 2, 2, 5, {**SUM, "gradient_predivide_factor": 2.0}, {}),
    **{f"unmanaged_stage{s}": ("fp32", s, 2, 5, {"managed_gradient_accumulation": False}, {}) for s in (1, 2)},
    "no_grad_norm_stage2": ("fp32", 2, 2, 5, {"gradient_clipping": 0.0}, {"compute_grad_norm": False}),
    "bf16_no_overflow_check_stage2": ("bf16", 2, 2, 5, {"bf16": {"enabled": True, "check_grad_overflow": False}}, {}),
    **{f"autocast_bf16_stage{s}": ("fp32", s, 2, 5, AUTOCAST, {}) for s in (1, 2)},
}
# ZeRO-Offload where each tensor is updated as its last reduced piece arrives (datapath/early_update.py): no
# clipping, bf16 without the overflow check; before the autocast scenarios (see above): they run after them
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
EARLY = {"gradient_clipping": 0.0, "bf16": {"enabled": True, "check_grad_overflow": False}}
# bf16.bf16_master_weights_and_grads and bf16_optimizer_states (DeepSpeed 0.18.3): tests/multiprocess/test_precision.py
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
STATES = {**MASTERS, "bf16_optimizer_states": True}
ACCUM_FP32 = {"data_types": {"grad_accum_dtype": "fp32"}}
CLIP = {"gradient_clipping": 0.3}  # below the norms: the clip factor applies, to bf16 gradients here
PRECISION = {
    "bf16_masters_states_stage1": ("bf16", 1, 2, 5, {"bf16": STATES}, {}),
    "bf16_masters_states_stage2": ("bf16", 2, 2, 5, {"bf16": STATES, **CLIP}, {}),
    "bf16_masters_offload_stage1": ("bf16", 1, 2, 5, {"bf16": MASTERS, **CLIP}, OFFLOAD),
    "bf16_masters_offload_stage2": ("bf16", 2, 2, 5, {"bf16": MASTERS}, OFFLOAD),
    "bf16_masters_states_offload_stage2": ("bf16", 2, 2, 5, {"bf16": STATES, **CLIP}, OFFLOAD),
    "bf16_masters_accum_fp32_stage2": ("bf16", 2, 2, 5, {"bf16": STATES, **CLIP, **ACCUM_FP32}, {}),
    "bf16_masters_accum_fp32_offload_stage1": ("bf16", 1, 2, 5, {"bf16": MASTERS, **CLIP, **ACCUM_FP32}, OFFLOAD),
}
# engine.coalesce_grad_reduction(): COALESCED backwards in one block, one step() after it (gradient_accumulation_steps
# 1, the boundary set on the block's last backward, as DeepSpeed's own tests do)
COALESCED = 3
SCENARIOS["coalesce_stage2"] = ("fp32", 2, 1, 4, {}, {})
TWO_RANK = {
    **{k: v for k, v in TWO_RANK.items() if not k.startswith("autocast")},
    "coalesce_fp32_stage1": ("fp32", 1, 1, 4, {}, {}),
    "coalesce_bf16_stage2": ("bf16", 2, 1, 4, {}, {}),
    "coalesce_offload_stage2": ("fp32", 2, 1, 4, {}, OFFLOAD),
    "offload_early_bf16_stage2": ("bf16", 2, 2, 5, EARLY, OFFLOAD),
    **{k: v for k, v in TWO_RANK.items() if k.startswith("autocast")},
}
TWO_RANK_EXTENDED = {"offload_early_bf16_stage1": ("bf16", 1, 2, 5, EARLY, OFFLOAD)}  # test_fidelity, -m extended
UNMANAGED_MICRO_STEPS = (3, 1, 2, 2, 1)  # backwards before each step() when the caller owns the boundary


class WithEmptyParameter(TinyGPT):
    """TinyGPT with a zero-element trainable parameter (stock ZeRO drops it)."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB, seq=SEQ)
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))


def run_case(case: str, out_dir: str) -> None:
    scenario, mode = case.split(":")
    dtype, stage, gas, steps, top, zero = {**SCENARIOS, **TWO_RANK, **TWO_RANK_EXTENDED, **PRECISION}[scenario]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = ds_config(dtype, mode, stage, world)
    config.update(gradient_accumulation_steps=gas, train_batch_size=MICRO_BATCH * gas * world, **top)
    config["zero_optimization"].update(zero)
    torch.manual_seed(1234)
    with model_device():
        if scenario == "zero_numel":
            model = WithEmptyParameter()
        else:
            model = TinyGPT(vocab=VOCAB, seq=SEQ, checkpointing=CHECKPOINTED.get(scenario))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    if scenario in COMPILED:
        engine.compile(backend=COMPILED[scenario])
    block_calls: list[None] = []  # the first block's forwards: with checkpointing, its recomputation too
    if scenario in CHECKPOINTED:
        engine.module.blocks[0].register_forward_pre_hook(lambda module, args: block_calls.append(None))
    losses, norms, scales = [], [], []
    micro = 0
    for step in range(steps):
        if scenario.startswith("coalesce"):  # the block's backwards reduce nothing; its exit reduces their sum once
            with engine.coalesce_grad_reduction():
                for g in range(COALESCED):
                    loss = engine(batch(rank, micro).to(engine.device))
                    engine.set_gradient_accumulation_boundary(g == COALESCED - 1)
                    engine.backward(loss)
                    losses.append(loss.item())
                    micro += 1
            engine.step()
            norms.append(float(engine.get_global_grad_norm() or 0.0))
            continue
        if scenario == "no_sync_stage1":  # two backwards without reduction, then one with it
            with engine.no_sync():
                for _ in range(2):
                    engine.backward(engine(batch(rank, micro).to(engine.device)))
                    micro += 1
        unmanaged = scenario.startswith("unmanaged")  # every step() is the boundary, after any number of backwards
        for g in range(UNMANAGED_MICRO_STEPS[step] if unmanaged else gas):
            loss = engine(batch(rank, micro).to(engine.device))
            if scenario.startswith("two_backwards") and g == 0:  # alternately the same loss and another one
                if len(norms) % 2:
                    engine.backward(loss, retain_graph=True)
                else:
                    engine.backward(engine(batch(rank, micro + 1000).to(engine.device)))
            if scenario.startswith("torch_backward"):  # PyTorch style; fp16 needs the loss scaled: engine.scale
                (engine.scale(loss) if dtype == "fp16" else loss).backward()
            else:
                engine.backward(loss)
            scales.append(float(optimizer.loss_scale) if hasattr(optimizer, "loss_scale") else 1.0)
            if not unmanaged:
                engine.step()
            losses.append(loss.item())
            micro += 1
        if unmanaged:
            engine.step()
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    result = {
        "losses": losses,
        "norms": norms,
        "loss_scales": scales,
        "skipped_steps": engine.skipped_steps,
        "optimizer_class": type(optimizer).__name__,
        "compiled": engine.is_compiled,
        "block_calls": len(block_calls),
        "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        # ds_tensorshard's early update: (reductions finished, buckets) when the first tensor was updated
        "first_update_at": getattr(getattr(optimizer, "early", None), "first_update_at", None),
        "inner_class": type(optimizer.optimizer).__name__,
        "state_dtypes": sorted(
            {
                str(t.dtype)
                for s in optimizer.optimizer.state.values()
                for t in s.values()
                if torch.is_tensor(t) and t.dim()
            }
        ),
    }
    torch.save(result, os.path.join(out_dir, f"{scenario}_{mode}.rank{rank}.pt"))


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    serve_cases(run_case, out_dir, cases)  # EMULATED_CUDA=1: emulated CUDA under NCCL's rules


if __name__ == "__main__":
    main()
