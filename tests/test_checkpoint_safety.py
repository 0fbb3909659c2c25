"""Loading a checkpoint never runs code from it (one rank, in this process).

A crafted file whose unpickling would create a file is refused, naming the file and the type, by
``engine.load_checkpoint`` and by ``ds-tensorshard convert-checkpoint``; ds_tensorshard's own rank
files hold only tensors and plain values; stock DeepSpeed checkpoints (with their loss scalers and
ZeRO stage enums) still load.
"""

from __future__ import annotations

import sys

import deepspeed
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from equivalence_worker import SEQ, VOCAB, ds_config, param_groups
from ranks import run_in_group
from tiny_gpt import TinyGPT

import ds_tensorshard  # noqa: F401
from ds_tensorshard.checkpoints.files import file_digest
from ds_tensorshard.checkpoints.rank_file import RankFile
from ds_tensorshard.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("single_rank_world")
RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class CreatesFile:
    """Unpickling this runs ``exec``, which creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('pwned')",)


def make_engine(dtype: str = "fp32", mode: str = "ts", stage: int = 2, seed: int = 7):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=ds_config(dtype, mode, stage, 1)
    )
    return engine


def train_and_save(engine, save_dir, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        engine.backward(engine(torch.randint(0, VOCAB, (2, SEQ), generator=gen)))
        engine.step()
    engine.save_checkpoint(str(save_dir), tag="t")


def plant(path, key: str, payload) -> None:
    """Put ``payload`` into a checkpoint file and re-record its digest, as an attacker would."""
    content = torch.load(path, weights_only=False)
    target = content["optimizer_state_dict"] if "optimizer_state_dict" in content else content
    target[key] = payload
    torch.save(content, path)
    (path.parent / (path.name + ".sha256")).write_text(file_digest(str(path)))


@pytest.fixture
def saved(tmp_path):
    train_and_save(make_engine(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


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


@pytest.mark.multiprocess
def test_payload_is_refused_by_convert_checkpoint(saved, tmp_path):
    marker = tmp_path / "created_by_payload"
    plant(saved / "t" / RANK_FILE, "loss_scaler", CreatesFile(str(marker)))
    for to, dst in (("fp32", tmp_path / "w.pt"), ("zero", tmp_path / "z"), ("tensorshard", tmp_path / "ts")):
        proc = run_in_group(
            [
                sys.executable,
                "-m",
                "ds_tensorshard.commands.cli",
                "convert-checkpoint",
                str(saved),
                str(dst),
                "--to",
                to,
            ],
            timeout=300,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert RANK_FILE in proc.stderr and "refers to exec," in proc.stderr, proc.stderr
        assert not marker.exists() and not dst.exists()


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
