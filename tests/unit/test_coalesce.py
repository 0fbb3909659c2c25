"""engine.coalesce_grad_reduction() (DeepSpeed 0.19.2) on a ds_tensorshard engine, in this process (one rank): the
block's backwards reduce nothing, its exit reduces their sum once, and the step equals the one after the same
backwards reduced one by one; where stock would use BF16_Optimizer the call is refused as stock refuses it.
Against stock at 2 and 3 ranks: the ``coalesce_*`` scenarios of tests/multiprocess/test_fidelity.py; at stage 3
the ``coalesce`` case of tests/multiprocess/test_stage3.py (-m extended)."""

from __future__ import annotations

import deepspeed
import pytest
import torch

import ds_tensorshard

pytestmark = pytest.mark.usefixtures("single_rank_world")
BACKWARDS = 3


def make(stage: int, **extra):
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "tensorshard": {"enabled": True},
        **extra,
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert isinstance(optimizer, ds_tensorshard.TensorShardOptimizer)
    return engine, optimizer


def backwards(engine, coalesced: bool) -> None:
    """BACKWARDS backwards, the boundary on the last, then one step()."""
    inputs = torch.randn(BACKWARDS, 2, 4, generator=torch.Generator().manual_seed(1))
    with engine.coalesce_grad_reduction() if coalesced else torch.enable_grad():
        for i in range(BACKWARDS):
            engine.set_gradient_accumulation_boundary(i == BACKWARDS - 1)
            engine.backward(engine(inputs[i].to(engine.module[0].weight.dtype)).float().square().sum())
    engine.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_block_reduces_the_sum_of_its_backwards_once_at_its_exit(stage):
    engine, optimizer = make(stage)
    inputs = torch.randn(BACKWARDS, 2, 4, generator=torch.Generator().manual_seed(1))
    expected = {}
    with engine.coalesce_grad_reduction():
        assert optimizer._coalesce_grad_reduction
        for i in range(BACKWARDS):
            engine.set_gradient_accumulation_boundary(i == BACKWARDS - 1)
            engine.backward(engine(inputs[i]).square().sum())
            assert optimizer.reducer.started == 0  # nothing reduced yet
            assert all(not section.buffer.any() for section in optimizer.shard.grads.sections)
        expected = {p: p.grad.clone() for p in engine.module.parameters()}  # the model's sum of the three
    assert not optimizer._coalesce_grad_reduction and not engine.inside_no_sync_ctxt
    for param, grad in expected.items():  # one rank: the owner's reduced gradient is the local sum
        assert torch.equal(optimizer.shard.grads.view(param).view_as(grad), grad) and param.grad is None
    engine.step()
    assert engine.global_steps == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_coalesced_step_equals_the_same_backwards_reduced_one_by_one(stage, dtype):
    extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    params = []
    for coalesced in (False, True):
        engine, _ = make(stage, **extra)
        for _ in range(2):
            backwards(engine, coalesced)
        params.append([p.detach().clone() for p in engine.module.parameters()])
    for ours, reference in zip(*params):
        assert torch.equal(ours, reference)


def test_refused_where_stock_would_use_bf16_optimizer():
    """Stock builds BF16_Optimizer for bf16 with grad_accum_dtype fp32 at stage 1 (no offload) and refuses the
    block there; ds_tensorshard replaces that optimizer and refuses it the same way. With offload stock's ZeRO
    optimizer runs it, and so does ds_tensorshard."""
    accum = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    engine, _ = make(1, **accum)
    with pytest.raises(NotImplementedError, match="does not yet support optimizer wrapper BF16_Optimizer"):
        with engine.coalesce_grad_reduction():
            pass
    assert not engine.inside_no_sync_ctxt
    engine, optimizer = make(1, **accum, zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}})
    backwards(engine, coalesced=True)
    assert engine.global_steps == 1 and optimizer.host is not None


def micro_step_ids(tensorshard: bool) -> list[int]:
    """A ZeRO-3 optimizer's ``micro_step_id`` after each forward of three accumulated backwards, at the flush of a
    coalesced block of three (the engine's flush spied as DeepSpeed's test spies it), and after each step."""
    config = {
        "train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
        "tensorshard": {"enabled": tensorshard},
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert isinstance(optimizer, ds_tensorshard.TensorShardOptimizer) == tensorshard
    seen, flush = [], engine._flush_coalesced_reduction_zero3
    engine._flush_coalesced_reduction_zero3 = lambda opt: (seen.append(opt.micro_step_id), flush(opt))[1]
    inputs = torch.randn(BACKWARDS, 2, 4, generator=torch.Generator().manual_seed(1))
    for coalesced in (False, True):
        with engine.coalesce_grad_reduction() if coalesced else torch.enable_grad():
            for i in range(BACKWARDS):
                loss = engine(inputs[i]).square().sum()
                seen.append(optimizer.micro_step_id)
                engine.set_gradient_accumulation_boundary(i == BACKWARDS - 1)
                engine.backward(loss)
        engine.step()
        seen.append(optimizer.micro_step_id)
    return seen


def test_micro_step_id_counts_the_backwards_since_the_step_as_stock_zero3():
    """What DeepSpeed's test_micro_step_id_is_zero_at_flush reads: 0 at a coalesced block's flush, else the backwards
    since the step, counted at the next forward."""
    ours, stock = micro_step_ids(True), micro_step_ids(False)
    assert ours == stock == [0, 1, 2, 0, 0, 0, 0, 0, 0], (ours, stock)
