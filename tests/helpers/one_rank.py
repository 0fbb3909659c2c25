"""Engines and checkpoints made in the test process itself (one gloo rank, see conftest's single_rank_world):
the checkpoint refusals need a rank 1 to break, and the safety tests a file to plant a payload in."""

from __future__ import annotations

import deepspeed
import torch

from ds_tensorshard.checkpoints.files import digest_path, file_digest
from tests.helpers.tiny_gpt import TinyGPT
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config, param_groups


class CreatesFile:
    """Unpickling this runs ``exec``, which creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('pwned')",)


def make_engine(dtype: str = "fp32", mode: str = "ts", stage: int = 2, seed: int = 7, **model_args):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, seq=SEQ, **model_args)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=ds_config(dtype, mode, stage, 1)
    )
    return engine


def train(engine, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        engine.backward(engine(torch.randint(0, VOCAB, (2, SEQ), generator=gen)))
        engine.step()


def train_and_save(engine, save_dir, steps: int = 2, tag: str = "t") -> None:
    train(engine, steps)
    engine.save_checkpoint(str(save_dir), tag=tag)


def lay_out_for_two(folder) -> str:
    """A ds_tensorshard checkpoint with two ranks' files: one rank trains and saves, and the converter lays
    the files out for two ranks. Returns the save dir (tag ``step3``)."""
    from ds_tensorshard.checkpoints.convert import convert

    train_and_save(make_engine(seed=5), folder / "one", tag="step3")
    convert(str(folder / "one"), str(folder / "c2"), "tensorshard", world_size=2)
    return folder / "c2"


def run_ds_to_universal(monkeypatch, *args: str) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal ARGS`` in this process (one worker: no pool)."""
    import sys

    from deepspeed.checkpoint import ds_to_universal

    argv = ["ds_to_universal", *args, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    ds_to_universal.main(ds_to_universal.parse_arguments())


def plant(path, key: str, payload) -> None:
    """Put ``payload`` into a checkpoint file and re-record its digest, as an attacker would."""
    content = torch.load(path, weights_only=False)
    target = content["optimizer_state_dict"] if "optimizer_state_dict" in content else content
    target[key] = payload
    torch.save(content, path)
    with open(digest_path(str(path)), "w") as f:
        f.write(file_digest(str(path)))
