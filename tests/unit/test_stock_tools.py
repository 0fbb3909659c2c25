"""DeepSpeed's own tools on ds_tensorshard saves (one rank, in this process): the zero_to_fp32 functions (and
HF's and Lightning's use of them), the zero_to_fp32.py in a save dir, save_16bit_model, ds_to_universal (a
refusal naming convert-checkpoint on a save; the `--to zero` output converted and loaded by stock ZeRO), and
a stock engine that loads a ds_tensorshard save stopping with an error naming ds_tensorshard.

fp32 weights and optimizer state go through these tools by copying, so every comparison is exact.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import runpy
import sys
import weakref

import deepspeed
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import zero_to_fp32

import ds_tensorshard  # noqa: F401
from ds_tensorshard.checkpoints import fp32_reader, stock_tools
from ds_tensorshard.checkpoints.consolidate import lazy_state_dict, parse_size, write_consolidated
from ds_tensorshard.checkpoints.convert import WeightsOptions, convert, fp32_state_dict
from ds_tensorshard.checkpoints.sources import open_checkpoint
from ds_tensorshard.checkpoints.zero3_source import Zero3Source
from ds_tensorshard.checkpoints.zero3_writer import to_zero3
from ds_tensorshard.errors import CheckpointError
from tests.helpers.one_rank import make_engine, run_ds_to_universal, train, train_and_save
from tests.helpers.tiny_gpt import TinyGPT
from tests.helpers.venvs import ensure_frameworks
from tests.workers.equivalence_worker import SEQ, VOCAB, ds_config, param_groups

pytestmark = pytest.mark.usefixtures("single_rank_world")

RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def saves(single_rank_world, tmp_path_factory):
    """The same model trained the same way by ds_tensorshard and by stock ZeRO-2, saved (tag ``t``), and
    ``convert-checkpoint --to fp32`` of the ds_tensorshard save."""
    d = tmp_path_factory.mktemp("saves")
    train_and_save(make_engine("fp32", "ts", 2), d / "ts")
    train_and_save(make_engine("fp32", "stock", 2), d / "stock")
    convert(str(d / "ts"), str(d / "weights.pt"), "fp32")
    return {"ts": d / "ts", "stock": d / "stock", "weights": torch.load(d / "weights.pt")}


def assert_same(ours: dict, reference: dict, dtype: torch.dtype = torch.float32) -> None:
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    for name, value in reference.items():
        assert ours[name].dtype == (dtype if value.is_floating_point() else value.dtype), name
        assert torch.equal(ours[name], value.to(ours[name].dtype)), name


def test_zero_to_fp32_functions_give_the_converters_weights(saves, tmp_path):
    reference = saves["weights"]
    # the public functions stay DeepSpeed's own objects (so a name bound before ds_tensorshard was imported
    # reaches the wrapper): only the module's reader of a tag folder is wrapped
    assert not hasattr(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint, "_ds_tensorshard_original")
    assert fp32_reader.installed()
    assert_same(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(saves["ts"])), reference)
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(saves["ts"]), "t", lazy_mode=True)
    assert_same({k: v.contiguous() for k, v in lazy.items()}, reference)  # lazy_mode's contract: read on contiguous()
    without_frozen = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        str(saves["ts"]), exclude_frozen_parameters=True
    )
    assert_same(without_frozen, {k: v for k, v in reference.items() if k != "frozen_scale"})
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(saves["ts"]), str(tmp_path / "out"))
    assert_same(torch.load(tmp_path / "out" / "pytorch_model.bin"), reference)
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(str(saves["ts"]), str(tmp_path / "bf16"), dtype="bf16")
    assert_same(torch.load(tmp_path / "bf16" / "pytorch_model.bin"), reference, torch.bfloat16)
    # HF's documented way (transformers itself no longer calls zero_to_fp32)
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(TinyGPT(vocab=VOCAB, seq=SEQ), str(saves["ts"]))
    assert_same(model.state_dict(), reference)


def test_a_stock_folder_still_goes_to_deepspeeds_code(saves):
    stock = str(saves["stock"] / "t")
    assert not fp32_reader.holds_tensorshard_rank_files(stock)
    original = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint._ds_tensorshard_original
    for exclude in (False, True):
        through_wrapper = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(saves["stock"]), "t", exclude)
        assert_same(through_wrapper, zero_to_fp32.to_torch_tensor(original(stock, exclude)))
        ours = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(saves["ts"]), "t", exclude)
        assert set(ours) == set(through_wrapper)  # stock's choice of entries, frozen ones left out alike


@pytest.mark.frameworks  # Lightning comes with the frameworks tier's extra
def test_lightning_converter(saves, tmp_path):
    ensure_frameworks()
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    written = convert_zero_checkpoint_to_fp32_state_dict(str(saves["ts"]), str(tmp_path / "lightning.pt"))
    assert_same(written["state_dict"], saves["weights"])
    assert_same(torch.load(tmp_path / "lightning.pt", weights_only=False)["state_dict"], saves["weights"])


def test_zero_to_fp32_py_in_the_save_dir_is_ds_tensorshards(saves, laid_out_for_two, tmp_path, monkeypatch):
    for script in (saves["ts"] / "zero_to_fp32.py", laid_out_for_two / "zero_to_fp32.py"):  # a save, --to tensorshard
        assert script.read_text() == open(stock_tools.SCRIPT).read() and os.access(script, os.X_OK)
    script = saves["ts"] / "zero_to_fp32.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(saves["ts"]), str(tmp_path / "out"), "-t", "t"])
    runpy.run_path(str(script), run_name="__main__")
    assert_same(torch.load(tmp_path / "out" / "pytorch_model.bin"), saves["weights"])
    if importlib.util.find_spec("safetensors"):  # streamed by ds_tensorshard, in DeepSpeed's shard names and index
        argv = [str(script), str(saves["ts"]), str(tmp_path / "st"), "-t", "t", "--safe_serialization"]
        monkeypatch.setattr(sys, "argv", [*argv, "--max_shard_size", "20KB"])
        runpy.run_path(str(script), run_name="__main__")
        assert (tmp_path / "st" / "model.safetensors.index.json").exists()
        assert_same(_safetensors_folder(tmp_path / "st"), saves["weights"])
    # DeepSpeed's zero_to_torch.py beside it imports it as zero_to_fp32
    monkeypatch.syspath_prepend(str(saves["ts"]))
    monkeypatch.delitem(sys.modules, "zero_to_fp32", raising=False)
    monkeypatch.setattr(sys, "argv", ["zero_to_torch.py", str(saves["ts"]), str(tmp_path / "torch"), "--dtype", "fp16"])
    runpy.run_path(str(saves["ts"] / "zero_to_torch.py"), run_name="__main__")
    sys.modules.pop("zero_to_fp32", None)
    assert_same(torch.load(tmp_path / "torch" / "pytorch_model.bin"), saves["weights"], torch.float16)


@pytest.mark.parametrize("inject", [False, True])
def test_ds_to_universal_refuses_a_tensorshard_save_naming_convert_checkpoint(saves, tmp_path, monkeypatch, inject):
    out = tmp_path / "universal"
    args = ["--input_folder", str(saves["ts"] / "t"), "--output_folder", str(out)]
    with pytest.raises(ValueError, match=r"ds_tensorshard checkpoint.*`ds-tensorshard convert-checkpoint .* --to zero"):
        run_ds_to_universal(monkeypatch, *args, *(["--inject_missing_state"] if inject else []))
    assert not out.exists()


def test_to_zero_writes_what_stock_zero_writes(saves, tmp_path):
    convert(str(saves["ts"]), str(tmp_path / "zero"), "zero", world_size=1, stage=2)
    ours = torch.load(tmp_path / "zero" / "t" / RANK_FILE, weights_only=False)
    stock = torch.load(saves["stock"] / "t" / RANK_FILE, weights_only=False)
    assert list(ours) == list(stock)
    assert list(ours["optimizer_state_dict"]) == list(stock["optimizer_state_dict"])
    for key in ("param_slice_mappings", "group_paddings", "partition_count", "zero_stage", "ds_version"):
        assert ours["optimizer_state_dict"][key] == stock["optimizer_state_dict"][key], key
    ours_states = torch.load(tmp_path / "zero" / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    stock_states = torch.load(saves["stock"] / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert list(ours_states) == list(stock_states)
    assert ours_states["param_shapes"] == stock_states["param_shapes"]
    listing = sorted(os.listdir(tmp_path / "zero"))
    assert listing == ["latest", "t", "zero_to_fp32.py", "zero_to_torch.py"]  # DeepSpeed's scripts, as a stock save
    assert (tmp_path / "zero" / "zero_to_fp32.py").read_bytes() == open(zero_to_fp32.__file__, "rb").read()
    stock_engine = make_engine("fp32", "stock", 2, seed=11)  # and stock ZeRO-2 loads it (its own file layout)
    stock_engine.load_checkpoint(str(tmp_path / "zero"))
    source = open_checkpoint(str(saves["ts"] / "t"))
    for name, param in stock_engine.module.named_parameters():
        if name in source.shapes:
            assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(param), source.tensor(name).master), name


def test_to_zero_feeds_ds_to_universal_and_stock_zero_loads_the_universal_checkpoint(saves, tmp_path, monkeypatch):
    # laid out for two ranks, so that ds_to_universal joins tensors split between two rank files
    convert(str(saves["ts"]), str(tmp_path / "zero"), "zero", world_size=2, stage=2)
    run_ds_to_universal(
        monkeypatch,
        "--input_folder",
        str(tmp_path / "zero" / "t"),
        "--output_folder",
        str(tmp_path / "zero" / "t_universal"),
        "--inject_missing_state",
    )
    torch.manual_seed(11)
    model = TinyGPT(vocab=VOCAB, seq=SEQ)
    config = {**ds_config("fp32", "stock", 2, 1), "checkpoint": {"load_universal": True}}
    stock, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    stock.load_checkpoint(str(tmp_path / "zero"))
    assert stock.global_steps == 2
    source = open_checkpoint(str(saves["ts"] / "t"))
    for name, param in stock.module.named_parameters():
        if name not in source.shapes:
            continue
        saved = source.tensor(name)
        assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(param), saved.master), name
        assert torch.equal(param.detach(), saved.master), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(deepspeed.utils.safe_get_full_optimizer_state(param, key), saved.state[key]), (name, key)
    steps = {int(s["step"]) for s in stock.optimizer.optimizer.state.values()}
    assert steps == {source.tensor(next(iter(source.shapes))).state["step"]}


def test_a_stock_engine_loading_a_tensorshard_save_stops_naming_ds_tensorshard(saves):
    stock = make_engine("fp32", "stock", 2, seed=11)
    with pytest.raises(Exception, match="ds_tensorshard rank file, not a ZeRO-1/2 optimizer file"):
        stock.load_checkpoint(str(saves["ts"]))


@pytest.mark.parametrize("dtype,stage", [("bf16", 1), ("fp16", 2)])
def test_save_16bit_model_saves_what_stock_saves(tmp_path, monkeypatch, dtype, stage):
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    saved = {}
    for mode in ("stock", "ts"):
        engine = make_engine(dtype, mode, stage)
        train(engine)
        assert engine.save_16bit_model(str(tmp_path / mode))
        saved[mode] = torch.load(tmp_path / mode / "pytorch_model.bin", weights_only=True)
        assert sorted(os.listdir(tmp_path / mode)) == ["pytorch_model.bin"]
    ours, theirs = saved["ts"], saved["stock"]
    assert list(ours) == list(theirs)
    for name, value in theirs.items():  # one rank trains bit-identically to stock (measured; compare.py: 2 ranks)
        assert value.dtype == getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
        assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name
    assert ours["head.weight"].data_ptr() == ours["wte.weight"].data_ptr()  # the tie kept, as in stock's file


def _safetensors_folder(folder) -> dict:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


def test_fp32_export_as_sharded_safetensors_and_torch_shards_in_any_dtype(saves, tmp_path):
    """``--to fp32 --safetensors [--max-shard-size] [--dtype]``: Hugging Face's file names and index, the weights of
    the single-file export (the tied alias its own entry); ``--max-shard-size`` alone: ``pytorch_model`` shards."""
    pytest.importorskip("safetensors")
    reference = saves["weights"]
    convert(str(saves["ts"]), str(tmp_path / "st"), "fp32", weights=WeightsOptions("fp32", True, "20KB"))
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and set(index["weight_map"]) == set(reference)
    assert_same(_safetensors_folder(tmp_path / "st"), reference)
    convert(str(saves["ts"]), str(tmp_path / "bf16"), "fp32", weights=WeightsOptions("bf16", True, None))
    assert os.listdir(tmp_path / "bf16") == ["model.safetensors"]
    assert_same(_safetensors_folder(tmp_path / "bf16"), reference, torch.bfloat16)
    convert(str(saves["ts"]), str(tmp_path / "bin"), "fp32", weights=WeightsOptions("fp16", False, "20KB"))
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    torch_shards: dict = {}
    for name in sorted(set(index["weight_map"].values())):
        torch_shards.update(torch.load(tmp_path / "bin" / name))
    assert len(set(index["weight_map"].values())) > 2
    assert_same(torch_shards, reference, torch.float16)


@pytest.mark.extended  # CI time (18 s): the streamed exports stay in tests/multiprocess/test_checkpoint.py
def test_safetensors_export_holds_one_tensor_at_a_time(saves, tmp_path):
    """Each tensor is read when it is written and gone before the next is read."""
    alive: list = []

    def tracked(read):
        def wrapper():
            gc.collect()
            assert sum(ref() is not None for ref in alive) == 0, "an earlier tensor is still held"
            tensor = read()
            alive.append(weakref.ref(tensor))
            return tensor

        return wrapper

    lazy = lazy_state_dict(open_checkpoint(str(saves["ts"] / "t")))
    for tensor in {id(t): t for t in lazy.values()}.values():
        tensor._read = tracked(tensor._read)
    write_consolidated(lazy, str(tmp_path / "out"), "fp32", safetensors=True)
    assert len(alive) == len(lazy)  # the tied alias read again for its own entry


def test_shard_sizes_read_as_hugging_face_writes_them():
    assert [parse_size(s) for s in ("5GB", "2GiB", "500MB", "20KB", "1000", 7)] == [5e9, 2**31, 5e8, 2e4, 1000, 7]
    with pytest.raises(CheckpointError, match="shard size '5 parsecs'"):
        parse_size("5 parsecs")


@pytest.mark.parametrize("sub_group_size", [1_000_000_000, 1000])
def test_zero3_layout_round_trip_keeps_every_master_and_moment(saves, tmp_path, sub_group_size):
    """Written in stock ZeRO-3's layout for 3 ranks (one sub-group per param group, or several of at least 1000
    elements each) and read back: every tensor's master, moments and step, and the frozen values, unchanged."""
    source = open_checkpoint(str(saves["ts"] / "t"))
    config = dict(source.model_states["ds_config"])
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "sub_group_size": sub_group_size}
    source.model_states = {**source.model_states, "ds_config": config}
    to_zero3(source, str(tmp_path), "t", world_size=3)
    back = Zero3Source(str(tmp_path / "t"))
    subs = len(back.model_states["param_shapes"])
    assert subs == 2 if sub_group_size > 10**6 else subs > 5
    assert back.group_names == source.group_names
    for name in source.shapes:
        ours, theirs = back.tensor(name), source.tensor(name)
        assert torch.equal(ours.master, theirs.master), name
        assert ours.state.keys() == theirs.state.keys(), name
        for key, value in theirs.state.items():
            assert torch.equal(ours.state[key], value) if torch.is_tensor(value) else ours.state[key] == value
    assert_same(fp32_state_dict(back), saves["weights"])
