"""engine.offload_states() / reload_states() on a ds_tensorshard engine (one rank, in-process).

On CPU both move tensors from the CPU to the CPU, that is nowhere; so the moves are also made to fresh
memory (a copy of every tensor, as a move to another device makes) to show that each state really moves,
that the masters which are views of an fp32 model's tensors follow them, and that training then continues
bit for bit. The memory freed on a GPU is measured by launch/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

from ds_tensorshard.errors import TensorShardUsageError
from tests.helpers.one_rank import make_engine
from tests.workers.equivalence_worker import SEQ, VOCAB

pytestmark = pytest.mark.usefixtures("single_rank_world")


def steps(engine, n: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n * engine.gradient_accumulation_steps()):
        loss = engine(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def pointers(engine) -> dict[str, int]:
    shard = engine.optimizer.shard
    found = {f"param {i}": p.data_ptr() for i, p in enumerate(engine.optimizer.params)}
    found.update({f"master {i}": m.data_ptr() for i, m in enumerate(shard.masters.values())})
    for i, state in enumerate(engine.optimizer.optimizer.state.values()):
        found.update({f"state {i} {k}": v.data_ptr() for k, v in state.items() if torch.is_tensor(v) and v.dim()})
    return found


@pytest.mark.parametrize("dtype,mode", [("fp32", "ts"), ("bf16", "ts"), ("fp32", "ts-flat"), ("bf16", "ts-flat")])
def test_offloaded_states_move_and_training_continues_bit_for_bit(dtype, mode):
    """With flat parameters (``ts-flat``) their storage moves whole and every parameter is a view of it again."""
    plain, moved = make_engine(dtype, mode), make_engine(dtype, mode)
    assert steps(plain, 2, seed=1) == steps(moved, 2, seed=1)
    before = pointers(moved)
    offload = moved.optimizer.offload
    for state in OffloadStateTypeEnum:  # to fresh memory, then back to fresh memory again
        offload._move(state, lambda t: t.clone())
    moved.offload_states()  # and through the engine, as users call it: on CPU a move onto the CPU
    assert offload.offloaded == set(OffloadStateTypeEnum)
    moved.reload_states()
    assert offload.offloaded == set()
    after = pointers(moved)
    assert [k for k in before if before[k] == after[k]] == []  # every tensor moved
    shard = moved.optimizer.shard
    for param in shard.views:  # an fp32 model's masters are still views of its tensors
        assert shard.masters[param].data_ptr() == param.data_ptr() + shard.blocks[param].start * 4
    flat = moved.optimizer.domains["data_parallel"].flat
    if flat is not None:
        base, offsets, size = flat.storage.data_ptr(), moved.optimizer.plan.flat_offsets, flat.storage.element_size()
        assert all(p.data_ptr() == base + offsets[moved.optimizer.names[p]] * size for p in flat.params)
    assert steps(plain, 2, seed=2) == steps(moved, 2, seed=2)
    for p, q in zip(plain.module.parameters(), moved.module.parameters()):
        assert torch.equal(p, q)


def test_with_zero_offload_the_host_states_stay_and_the_device_ones_move():
    """ZeRO-Offload keeps masters and optimizer state in host memory, where the host optimizer steps them:
    engine.offload_states() moves the model's tensors and gradients only (DeepSpeed's engine leaves the host
    states out, from 0.19.0); asked for them directly, the optimizer refuses before anything moves (an engine
    that passed them on would have reload_states() move them to the accelerator, where the host optimizer
    cannot step them). Training then goes on as without."""
    plain, moved = make_engine("fp32", mode="ts-offload"), make_engine("fp32", mode="ts-offload")
    assert steps(plain, 1, seed=1) == steps(moved, 1, seed=1)
    with pytest.raises(TensorShardUsageError, match=r"\['optim_states', 'hp_params'\] with ZeRO-Offload.*lp_params"):
        moved.optimizer.offload_states()
    with pytest.raises(TensorShardUsageError, match=r"\['optim_states'\]"):
        moved.optimizer.offload_states(include=[OffloadStateTypeEnum.optim_states])
    assert moved.optimizer.offload.offloaded == set()
    moved.offload_states()
    assert moved.optimizer.offload.offloaded == set(OffloadStateTypeEnum) - {
        OffloadStateTypeEnum.hp_params,
        OffloadStateTypeEnum.optim_states,
    }
    moved.reload_states()
    assert steps(plain, 2, seed=2) == steps(moved, 2, seed=2)


@pytest.mark.parametrize("state", list(OffloadStateTypeEnum), ids=lambda s: s.name)
def test_each_state_alone_moves_and_training_continues_bit_for_bit(state):
    """One state moved to fresh memory and back, the others left: the masters keep their gradients where
    both are back on one device (while apart, none: a gradient on another device cannot be attached), the
    views and lists made once are made again, and training goes on bit for bit."""
    plain, moved = make_engine("fp32"), make_engine("fp32")
    assert steps(plain, 1, seed=1) == steps(moved, 1, seed=1)
    moved.optimizer.offload._move(state, lambda t: t.clone())
    shard = moved.optimizer.shard
    for param, master in shard.masters.items():
        assert master.grad is not None and master.grad.data_ptr() == shard.step_gradient(param).data_ptr()
    assert steps(plain, 2, seed=2) == steps(moved, 2, seed=2)
    for p, q in zip(plain.module.parameters(), moved.module.parameters()):
        assert torch.equal(p, q)


def test_stage3_moves_each_ranks_ds_tensors_releases_and_gathers_again_and_training_continues_bit_for_bit():
    """Stage 3 (one rank: it owns every tensor): the model's tensors are the parameters' ds_tensors, which move
    (to fresh memory); engine.offload_states() first releases the gathered parameters, the persistent ones too,
    and reload_states() gathers those again; training then goes on bit for bit. With ZeRO-Offload, the refusal
    of the host-resident states comes before anything is released."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    plain, moved = make_engine("fp32", stage=3), make_engine("fp32", stage=3)
    assert steps(plain, 1, seed=1) == steps(moved, 1, seed=1)
    params = list(moved.module.parameters())
    before = [p.ds_tensor.data_ptr() for p in params]
    moved.optimizer.offload._move(OffloadStateTypeEnum.lp_params, lambda t: t.clone())
    assert all(p.ds_tensor.data_ptr() != b for p, b in zip(params, before))
    persistent = moved.optimizer.persistent_parameters
    assert persistent and all(p.ds_status is ZeroParamStatus.AVAILABLE for p in persistent)
    moved.offload_states()
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in persistent)
    moved.reload_states()
    assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in persistent)
    assert steps(plain, 2, seed=2) == steps(moved, 2, seed=2)
    offloaded = make_engine("fp32", mode="ts-offload", stage=3)
    steps(offloaded, 1, seed=1)
    with pytest.raises(TensorShardUsageError, match="with ZeRO-Offload"):
        offloaded.optimizer.offload_states()
    kept = offloaded.optimizer.persistent_parameters
    assert kept and all(p.ds_status is ZeroParamStatus.AVAILABLE for p in kept)
