"""Stage-3 checkpoints in this process (one rank; real ranks in tests/multiprocess/test_checkpoint.py): the folder
keeps stage 2's layout with each parameter once, a save resumes bit for bit (fp32 and bf16), a stage-1/2 engine
loads it, loads without optimizer state read the tag asked for, DeepSpeed's zero_to_fp32 and the conversions give
the whole model, and bad input is refused naming the file or tensor before any state is touched.

Every parameter is released between uses (``stage3_param_persistence_threshold`` 0), as on a model too large to
keep gathered.
"""

from __future__ import annotations

import os

import deepspeed
import pytest
import torch
from deepspeed.utils import zero_to_fp32

import ds_tensorshard  # noqa: F401
from ds_tensorshard.checkpoints.convert import convert
from ds_tensorshard.checkpoints.files import digest_path, file_digest
from ds_tensorshard.errors import CheckpointError
from tests.helpers.one_rank import make_engine, run_ds_to_universal, train
from tests.helpers.tiny_gpt import TinyGPT
from tests.helpers.venvs import ensure_frameworks
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config, param_groups

pytestmark = pytest.mark.usefixtures("single_rank_world")

RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def stage3_engine(dtype: str = "fp32", stage: int = 3, seed: int = 11, buffer: bool = False, **model_args):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, seq=SEQ, **model_args)
    if buffer:  # a persistent buffer, which stage 3 does not partition
        model.register_buffer("counts", torch.zeros(5))
    config = ds_config(dtype, "ts", stage, 1)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def gathered(engine) -> dict[str, torch.Tensor]:
    """The parameters as users gather them (``GatheredParameters`` at stage 3)."""
    stage3 = engine.zero_optimization_partition_weights()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage3):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def held(engine) -> dict:
    """Everything a load may change: what each rank keeps of every parameter, the masters and optimizer state."""
    stage3 = engine.zero_optimization_partition_weights()
    kept = {n: (p.ds_tensor if stage3 else p).detach().clone() for n, p in engine.module.named_parameters()}
    masters = [m.detach().clone() for m in engine.optimizer.shard.masters.values()]
    return {
        "kept": kept,
        "masters": masters,
        "state": len(engine.optimizer.optimizer.state),
        "step": engine.global_steps,
    }


def assert_equal(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name


@pytest.fixture(scope="module")
def saved(single_rank_world, tmp_path_factory):
    """A stage-3 run per dtype saved after 3 steps (tag ``a``) and after a 4th (``b``, ``latest``), with its
    parameters at each save."""
    d = tmp_path_factory.mktemp("stage3")
    out: dict = {"dir": d}
    for dtype in ("fp32", "bf16"):
        engine = stage3_engine(dtype, seed=7)
        train(engine, 3)
        engine.save_checkpoint(str(d / dtype), tag="a")
        out[dtype, "a"] = gathered(engine)
        train(engine, 1)
        engine.save_checkpoint(str(d / dtype), tag="b")
        out[dtype, "b"] = gathered(engine)
    return out


def test_the_folder_has_stage_2s_layout_and_each_parameter_once(saved):
    folder = saved["dir"] / "fp32" / "a"
    files = sorted(e for e in os.listdir(folder) if not e.startswith("."))
    assert files == ["mp_rank_00_model_states.pt", RANK_FILE]  # no per-rank module files: any world size loads it
    states = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    assert {n: tuple(v.shape) for n, v in states["module"].items()} == {n: (0,) for n in states["module"]}
    assert states["frozen_param_fragments"] is None and states["shared_params"] == {"head.weight": "wte.weight"}
    rank_file = torch.load(folder / RANK_FILE, weights_only=False)["optimizer_state_dict"]
    assert rank_file["zero_stage"] == 2  # the layout's, where Lightning's converter looks for the module file
    assert sorted(rank_file["parameters"]) == ["frozen_scale"]  # untrained: its owner's tensor
    assert sorted(rank_file["tensors"]) == sorted(n for n in saved["fp32", "a"] if n != "frozen_scale")
    assert torch.equal(rank_file["parameters"]["frozen_scale"]["value"], saved["fp32", "a"]["frozen_scale"])
    for name, entry in rank_file["tensors"].items():  # the masters: an fp32 model's parameters themselves
        assert torch.equal(entry["master"], saved["fp32", "a"][name]), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_save_resumes_bit_for_bit(saved, dtype):
    engine = stage3_engine(dtype)
    engine.load_checkpoint(str(saved["dir"] / dtype), tag="a")
    assert engine.global_steps == 3
    assert_equal(gathered(engine), saved[dtype, "a"])
    train(engine, 1)  # the 4th step of the saved run, on the same batches
    assert_equal(gathered(engine), saved[dtype, "b"])


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("how", [{"load_optimizer_states": False}, {"load_module_only": True}])
def test_a_load_without_optimizer_state_reads_the_tag_asked_for(saved, tmp_path, stage, how):
    """Stock's stage-3 load without optimizer state takes the module from zero_to_fp32 of the ``latest`` tag
    (here one that is gone); the tag asked for is loaded, and the masters are the parameters."""
    copy_tag(saved["dir"] / "fp32" / "a", tmp_path / "c" / "a")
    (tmp_path / "c" / "latest").write_text("gone")
    engine = stage3_engine("fp32", stage)
    engine.load_checkpoint(str(tmp_path / "c"), tag="a", **how)
    assert_equal(gathered(engine), saved["fp32", "a"])
    named = {p: n for n, p in engine.module.named_parameters()}
    for param, master in engine.optimizer.shard.masters.items():
        assert torch.equal(master.view(-1), saved["fp32", "a"][named[param]].view(-1)), named[param]
    assert len(engine.optimizer.optimizer.state) == 0


def copy_tag(source, target) -> None:
    target.mkdir(parents=True)
    for entry in os.listdir(source):
        (target / entry).write_bytes((source / entry).read_bytes())


def test_a_stage_2_engine_resumes_a_stage_3_save(saved):
    engine = stage3_engine("fp32", stage=2)
    engine.load_checkpoint(str(saved["dir"] / "fp32"), tag="a")
    assert_equal(gathered(engine), saved["fp32", "a"])
    train(engine, 1)
    assert_equal(gathered(engine), saved["fp32", "b"])


def test_zero_to_fp32_and_the_conversions_give_the_whole_model(saved, tmp_path):
    reference = dict(saved["fp32", "b"], **{"head.weight": saved["fp32", "b"]["wte.weight"]})  # tied, saved once
    assert_equal(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(saved["dir"] / "fp32")), reference)
    without = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(saved["dir"] / "fp32"), "b", True)
    assert_equal(without, {n: v for n, v in reference.items() if n != "frozen_scale"})
    convert(str(saved["dir"] / "fp32"), str(tmp_path / "zero"), "zero", world_size=1, stage=2)
    stock = make_engine("fp32", "stock", 2, seed=11)  # stock ZeRO-2 loads the whole model from the conversion
    stock.load_checkpoint(str(tmp_path / "zero"))
    assert_equal(gathered(stock), saved["fp32", "b"])


def test_a_universal_checkpoint_loads_at_stage_3(saved, tmp_path, monkeypatch):
    """DeepSpeed loads no module from a universal checkpoint (and at stage 3 writes no masters into the model):
    the owners' bf16 tensors are their loaded masters, cast (here a stage-3 save through --to zero)."""
    convert(str(saved["dir"] / "bf16"), str(tmp_path / "zero"), "zero", world_size=1, stage=2)
    folder = str(tmp_path / "zero" / "b")
    run_ds_to_universal(
        monkeypatch, "--input_folder", folder, "--output_folder", f"{folder}_universal", "--inject_missing_state"
    )
    torch.manual_seed(11)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    config = {**ds_config("bf16", "ts", 3, 1), "checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    engine.load_checkpoint(str(tmp_path / "zero"))
    assert_equal(gathered(engine), saved["bf16", "b"])  # frozen_scale: not in a universal checkpoint, 0.5 in both


def test_buffers_load_as_usual(tmp_path):
    engine = stage3_engine("fp32", seed=7, buffer=True)
    train(engine, 1)
    engine.module.counts.copy_(torch.arange(5.0))
    engine.save_checkpoint(str(tmp_path / "c"), tag="t")
    expected = gathered(engine)
    fresh = stage3_engine("fp32", buffer=True)
    fresh.load_checkpoint(str(tmp_path / "c"))
    assert torch.equal(fresh.module.counts, torch.arange(5.0))
    assert_equal(gathered(fresh), expected)


@pytest.mark.frameworks  # Lightning comes with the frameworks tier's extra
def test_lightnings_converter_reads_a_stage3_save(saved, tmp_path):
    """Lightning finds the module file by the rank files' ``zero_stage`` (2: the folder's layout) and the weights
    through zero_to_fp32."""
    ensure_frameworks()
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    written = convert_zero_checkpoint_to_fp32_state_dict(str(saved["dir"] / "fp32"), str(tmp_path / "lightning.pt"))
    assert_equal(written["state_dict"], {**saved["fp32", "b"], "head.weight": saved["fp32", "b"]["wte.weight"]})


def refused(engine, load_dir, message: str, **kwargs) -> None:
    before = held(engine)
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(str(load_dir), **kwargs)
    after = held(engine)
    assert after["state"] == before["state"] and after["step"] == before["step"]
    assert_equal(after["kept"], before["kept"])
    assert all(torch.equal(a, b) for a, b in zip(after["masters"], before["masters"]))


def test_bad_input_is_refused_by_name_before_any_state_is_touched(saved, tmp_path):
    engine = stage3_engine("fp32")
    train(engine, 1)
    refused(stage3_engine("fp32", width=48), saved["dir"] / "fp32", r"tensor '.*' has shape .* in checkpoint")
    refused(engine, saved["dir"] / "fp32", "custom_load_fn.* at ZeRO stage 3", custom_load_fn=lambda src, dst: None)
    # a rank file without the untrained parameter it kept
    damaged = tmp_path / "damaged" / "a"
    copy_tag(saved["dir"] / "fp32" / "a", damaged)
    content = torch.load(damaged / RANK_FILE, weights_only=False)
    del content["optimizer_state_dict"]["parameters"]["frozen_scale"]
    torch.save(content, damaged / RANK_FILE)
    with open(digest_path(str(damaged / RANK_FILE)), "w") as f:
        f.write(file_digest(str(damaged / RANK_FILE)))
    refused(engine, damaged.parent, "has no value of 'frozen_scale' of the model", tag="a")
    # stock ZeRO-3's own folder (one module file per rank): named, not loaded
    stock = make_engine("fp32", "stock", 3, seed=5)
    train(stock, 1)
    stock.save_checkpoint(str(tmp_path / "stock3"), tag="s")
    refused(engine, tmp_path / "stock3", "is a stock ZeRO-3 checkpoint")


def test_a_save_without_frozen_parameters_loads_only_non_strict(tmp_path):
    engine = stage3_engine("fp32", seed=7)
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "c"), tag="t", exclude_frozen_parameters=True)
    expected = gathered(engine)
    rank_file = torch.load(tmp_path / "c" / "t" / RANK_FILE, weights_only=False)["optimizer_state_dict"]
    assert rank_file["parameters"] == {}
    fresh = stage3_engine("fp32")
    initial = gathered(fresh)["frozen_scale"]
    refused(fresh, tmp_path / "c", "has no value of 'frozen_scale' of the model")
    fresh.load_checkpoint(str(tmp_path / "c"), load_module_strict=False)
    assert_equal(gathered(fresh), {**expected, "frozen_scale": initial})
