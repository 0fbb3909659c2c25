"""Loading a checkpoint never runs code from it (one rank, in this process): a crafted file whose unpickling
would create a file is refused by ``engine.load_checkpoint``, naming the file and the type; ds_tensorshard's
own rank files hold only tensors and plain values; stock checkpoints (loss scalers, ZeRO stage enums) load.
"""

from __future__ import annotations

import pytest
import torch
from deepspeed.accelerator import get_accelerator

import ds_tensorshard  # noqa: F401
from ds_tensorshard.checkpoints.rank_file import RankFile
from ds_tensorshard.errors import CheckpointError
from tests.helpers.one_rank import CreatesFile, make_engine, plant, train_and_save

pytestmark = pytest.mark.usefixtures("single_rank_world")

RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize("victim,key", [(RANK_FILE, "loss_scaler"), ("mp_rank_00_model_states.pt", "lr_scheduler")])
def test_payload_is_refused_by_load_checkpoint_and_runs_nothing(saved, tmp_path, victim, key):
    marker = tmp_path / "created_by_payload"
    plant(saved / "t" / victim, key, CreatesFile(str(marker)))
    engine = make_engine(seed=11)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(CheckpointError, match=rf"refusing to load checkpoint file .*{victim}: it refers to exec,"):
        engine.load_checkpoint(str(saved))
    assert not marker.exists()
    assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert len(engine.optimizer.optimizer.state) == 0 and engine.global_steps == 0


def test_own_rank_file_holds_only_tensors_and_plain_values(saved):
    payload = torch.load(saved / "t" / RANK_FILE, weights_only=True)["optimizer_state_dict"]  # no allow-list
    rank_file = RankFile.from_dict(payload, RANK_FILE)
    assert rank_file.loss_scaler["cur_scale"] == 1.0 and rank_file.loss_scaler["dynamic"] is False
    assert all("master" in entry and "exp_avg" in entry for entry in rank_file.tensors.values())


@pytest.mark.parametrize("dtype,stage", [("fp16", 2), ("bf16", 1)])
def test_stock_checkpoint_with_deepspeed_types_still_loads(tmp_path, monkeypatch, dtype, stage):
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    stock = make_engine(dtype, "stock", stage)
    train_and_save(stock, tmp_path / "stock")
    engine = make_engine(dtype, "ts", stage, seed=11)
    path, _ = engine.load_checkpoint(str(tmp_path / "stock"))
    assert path is not None and engine.global_steps == stock.global_steps
    assert engine.optimizer.loss_scale == stock.optimizer.loss_scale
    assert engine.optimizer.dynamic_loss_scale == (dtype == "fp16")
    for (name, ours), theirs in zip(engine.module.named_parameters(), stock.module.parameters()):
        assert torch.equal(ours, theirs), name
    assert len(engine.optimizer.optimizer.state) == sum(p.requires_grad for p in engine.module.parameters())


class _ByName:
    """Pickles as ``getattr(owner, name)``: how Python 3.11.2 (Debian 12's) pickles an int-valued enum member."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_enum_member_pickled_by_name_loads_and_nothing_else_does(tmp_path):
    """A stock checkpoint written under Python 3.11.2 holds ``ZeroStageEnum.gradients`` as getattr(enum, name)
    (measured: a clean venv on Debian's python3 refused every stock checkpoint); only members of DeepSpeed's
    enums are given, any other attribute is refused naming getattr."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from ds_tensorshard.checkpoints import files

    path = tmp_path / "by_name.pt"
    torch.save({"zero_stage": _ByName(ZeroStageEnum, "gradients")}, path)
    assert files.load(str(path)) == {"zero_stage": ZeroStageEnum.gradients}
    for owner, name in [(ZeroStageEnum, "__class__"), (ZeroStageEnum, "missing"), (LossScaler, "__init__")]:
        torch.save({"x": _ByName(owner, name)}, path)
        with pytest.raises(CheckpointError, match="refers to builtins.getattr"):
            files.load(str(path))
