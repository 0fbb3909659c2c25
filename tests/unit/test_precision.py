"""bf16.bf16_master_weights_and_grads and bf16_optimizer_states (DeepSpeed 0.18.3), in this process (one rank): bf16
masters are the model's own tensors, the optimizer state follows stock's dtype, and what stock's constructor
refuses is refused with its message. Against stock at 2 and 3 ranks: tests/multiprocess/test_precision.py."""

from __future__ import annotations

import deepspeed
import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

import ds_tensorshard
from ds_tensorshard.errors import RefusedAsStock, TensorShardConfigError

pytestmark = pytest.mark.usefixtures("single_rank_world")
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def make(bf16: dict, zero: dict | None = None, optimizer=None, **extra):
    config = {
        "train_batch_size": 2,
        "zero_optimization": zero or {"stage": 2},
        "bf16": bf16,
        "tensorshard": {"enabled": True},
        **({} if optimizer else {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}),
        **extra,
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    client = optimizer(model.parameters()) if optimizer else None
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, optimizer=client
    )
    return engine, opt


def step(engine) -> None:
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().square().sum())
    engine.step()


def state_dtypes(opt) -> set[torch.dtype]:
    return {t.dtype for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_masters_are_the_models_own_tensors_and_the_state_is_bf16(stage):
    engine, opt = make({**MASTERS, "bf16_optimizer_states": True}, {"stage": stage})
    assert isinstance(opt, ds_tensorshard.TensorShardOptimizer) and opt.shard.master_dtype == torch.bfloat16
    for param, master in opt.shard.masters.items():
        assert master.dtype == torch.bfloat16 and master.data_ptr() == param.data_ptr()  # no copy
    before = [p.detach().clone() for p in engine.module.parameters()]
    step(engine)
    assert state_dtypes(opt) == {torch.bfloat16}  # FusedAdam makes its moments like the (bf16) master
    assert all(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))


@pytest.mark.parametrize("states,expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_offloaded_bf16_masters_are_host_copies_stepped_by_deepspeeds_cpu_adam(states, expected):
    engine, opt = make({**MASTERS, "bf16_optimizer_states": states}, OFFLOAD)
    assert type(opt.optimizer).__name__ == "DeepSpeedCPUAdam" and opt.host is not None
    assert all(m.dtype == torch.bfloat16 and m.device.type == "cpu" for m in opt.shard.masters.values())
    step(engine)
    assert state_dtypes(opt) == {expected}  # fp32 moments unless bf16_optimizer_states, as stock's CPU Adam


def test_bf16_masters_where_stock_builds_bf16_optimizer_stay_fp32():
    """Stage 1 with bf16 and fp32 gradient accumulation (no offload): stock's BF16_Optimizer keeps fp32 masters
    whatever the keys say, and so does ds_tensorshard."""
    _, opt = make({**MASTERS, "bf16_optimizer_states": True}, {"stage": 1}, data_types={"grad_accum_dtype": "fp32"})
    assert opt.shard.master_dtype == torch.float32


@pytest.mark.parametrize(
    "bf16,zero,optimizer,message",
    [
        (MASTERS, None, None, "Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam"),
        (
            MASTERS,
            {"stage": 1, "offload_optimizer": {"device": "cpu"}},
            lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            "Master weights feature requires ZeRO-1 Offload with DeepSpeedCPUAdam",
        ),
        (
            {**MASTERS, "bf16_optimizer_states": True},
            OFFLOAD,
            lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, fp32_optimizer_states=True),
            "bf16_optimizer_states with ZeRO-Offload requires DeepSpeedCPUAdam constructed with fp32_optimizer_states",
        ),
    ],
)
def test_what_stocks_constructor_asserts_is_refused_with_its_message(bf16, zero, optimizer, message):
    extra = {"zero_force_ds_cpu_optimizer": False} if optimizer else {}
    with pytest.raises(RefusedAsStock, match=message) as refused:
        make(bf16, zero, optimizer, **extra)
    assert isinstance(refused.value, AssertionError)


def test_bf16_masters_with_an_optimizer_not_matched_against_stock_is_refused():
    with pytest.raises(
        TensorShardConfigError, match="'bf16.bf16_master_weights_and_grads' with the inner optimizer SGD"
    ):
        make({**MASTERS, "bf16_optimizer_states": True}, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2))


def batches() -> torch.Tensor:
    """Four bf16 batches for the checkpoint tests."""
    torch.manual_seed(5)
    return torch.randn(4, 2, 4, dtype=torch.bfloat16)


def train(engine, inputs: torch.Tensor) -> None:
    for x in inputs:
        engine.backward(engine(x).float().square().sum())
        engine.step()


@pytest.mark.parametrize("zero", [{"stage": 2}, OFFLOAD], ids=["device", "offload"])
def test_a_bf16_master_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path, zero):
    """Saved and loaded with its bf16 masters and moments: 2 steps, save, a new engine loads, 2 more steps equal
    4 uninterrupted ones."""
    bf16, inputs = {**MASTERS, "bf16_optimizer_states": True}, batches()
    whole, _ = make(bf16, zero)
    train(whole, inputs)
    first, _ = make(bf16, zero)
    train(first, inputs[:2])
    first.save_checkpoint(str(tmp_path), tag="t")
    resumed, opt = make(bf16, zero)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert state_dtypes(opt) == {torch.bfloat16}
    train(resumed, inputs[2:])
    for a, b in zip(whole.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_a_stock_bf16_master_checkpoint_continues_as_stock_continues(tmp_path):
    """Stock ZeRO-2 with bf16 masters and moments saves after 2 steps; stock and ds_tensorshard each load it and
    take 2 more steps: the same parameters, bit for bit, the loaded moments still bf16."""
    bf16, inputs = {**MASTERS, "bf16_optimizer_states": True}, batches()
    stock, _ = make(bf16, tensorshard={"enabled": False})
    train(stock, inputs[:2])
    stock.save_checkpoint(str(tmp_path), tag="t")
    runs = []
    for enabled in (False, True):
        engine, opt = make(bf16, tensorshard={"enabled": enabled})
        engine.load_checkpoint(str(tmp_path), tag="t")
        assert isinstance(opt, ds_tensorshard.TensorShardOptimizer) == enabled
        assert state_dtypes(opt) == {torch.bfloat16}
        train(engine, inputs[2:])
        runs.append(list(engine.module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
