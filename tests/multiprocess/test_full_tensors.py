"""``deepspeed.utils``' safe_get_full_* / safe_set_full_* on ds_tensorshard give what stock ZeRO-1/2 gives, on
every rank, for the split (tied) embedding and for whole tensors; what they set changes training as under
stock; and where stock fails on some ranks and leaves the others waiting, every rank raises. Real ranks on
gloo, one launch per world size (see full_tensor_worker.py; the mpi transport's run is in test_mpi.py).

DeepSpeed's own tests/unit/runtime/zero/test_zero_tensor_fragment.py, for what runs on CPU at stages 1-2
(no offload): TestTensorFragmentGet (fp32 master and gradient after backward, exp_avg/exp_avg_sq after step,
None for frozen parameters, local API refused), TestTensorFragmentSet (gradient and master set after
backward, master and moments set after step, each read back exactly) and TestTensorFragmentUpdate
(safe_update_full_grad_vectorized read back), here for fp32 at stages 1 and 2 and, at 2 ranks, bf16 and fp16.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import assert_full_tensors_match, assert_run_matches
from tests.helpers.emulated_accelerator import EMULATED
from tests.helpers.ranks import run_ranks
from tests.workers.full_tensor_worker import SPLIT, setter_values

CASES = {2: ["fp32:1", "fp32:2", "bf16:2", "fp16:1"], 3: ["fp32:1", "fp32:2"]}
EXACT_UP_TO = 2  # world sizes where every value is stock's bit for bit (measured: every dtype and stage)
LOCAL = ("getter", "state getter", "grad getter", "setter")  # the ZeRO-3-only calls the worker tries


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.extended)])  # 3 ranks: CI time
def runs(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"full{n}")
    cases = [f"{dtype}:{mode}:{stage}" for dtype, stage in (c.split(":") for c in CASES[n]) for mode in ("stock", "ts")]
    run_ranks([os.path.join(WORKERS, "full_tensor_worker.py"), str(out), *cases], n)
    loaded: dict[tuple[str, int], dict] = {}

    def load(case: str, rank: int) -> dict:
        if (case, rank) not in loaded:
            loaded[case, rank] = torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt")
        return loaded[case, rank]

    return n, load


def pairs(n):
    for case in CASES[n]:
        dtype, stage = case.split(":")
        yield dtype, f"{dtype}:ts:{stage}", f"{dtype}:stock:{stage}"


def test_getters_give_stocks_values_on_every_rank(runs):
    n, load = runs
    for _, ours_case, stock_case in pairs(n):
        first = load(ours_case, 0)["seen"]
        for rank in range(n):
            ours, stock = load(ours_case, rank), load(stock_case, rank)
            assert ours["optimizer_class"] == "TensorShardOptimizer"
            assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer"
            assert list(ours["split"]) == [SPLIT]  # the embedding is owned in blocks, every other tensor whole
            assert_full_tensors_match(ours, stock, n <= EXACT_UP_TO, f"{ours_case} rank {rank}")
            for key, value in ours["seen"].items():
                if " local grad " not in key:  # param.grad is each rank's own; the rest is the same everywhere
                    assert torch.equal(value, first[key]), f"{ours_case}: ranks {rank} and 0 differ: {key}"
            assert ours["frozen_is_none"] == stock["frozen_is_none"] == [True, True]


def test_setters_change_training_as_stock(runs):
    n, load = runs
    for dtype, ours_case, stock_case in pairs(n):
        for rank in range(n):
            ours, stock = load(ours_case, rank), load(stock_case, rank)
            where = f"{ours_case} vs {stock_case} rank {rank}"
            values = setter_values({name: value.shape for name, value in ours["params"].items()})
            assert ours["set_read_back"] == stock["set_read_back"] == dict.fromkeys(values, True), where
            assert ours["model_unchanged_by_set"] and stock["model_unchanged_by_set"], where
            assert_run_matches(ours, stock, dtype, where)
            # step 2 starts from the masters set after step 1, far from where training had them
            for target in ("master:" + SPLIT, "master:blocks.0.proj.weight"):
                name = target.split(":")[1]
                moved = (ours["seen"][f"after step 2 master {name}"] - values[target]).abs().mean()
                away = (ours["seen"][f"after step 1 master {name}"] - values[target]).abs().mean()
                assert moved < 0.1 * away, f"{where}: {name} moved {moved} from what was set ({away} away)"


def test_refusals_on_every_rank(runs):
    n, load = runs
    for _, ours_case, _ in pairs(n):
        stage = ours_case.split(":")[2]
        expected = {
            "state before step 1": ("TensorAccessError", "yet"),
            "gradient after step": ("TensorAccessError", "before engine.step()"),
            "unknown key": ("TensorAccessError", "'momentum_buffer'"),
            "unknown key (set)": ("TensorAccessError", "'exp_avgs'"),
            "wrong shape": ("TensorAccessError", "(3, 32)"),
            **{f"local {what}": ("AssertionError", "ZeRO-3") for what in LOCAL},
        }
        if stage == "2":
            expected["stage 2 gradient before the boundary"] = ("TensorAccessError", "accumulation boundary")
        for rank in range(n):
            refusals = load(ours_case, rank)["refusals"]
            assert refusals.keys() == expected.keys(), f"{ours_case} rank {rank}"
            for what, (kind, text) in expected.items():
                message = refusals[what]
                assert message.startswith(kind) and text in message, f"{ours_case} rank {rank} {what}: {message}"
                if kind == "TensorAccessError":
                    assert f"'{SPLIT}'" in message, message


EMULATED_CASES = ["fp32:ts:1", "bf16:ts:2"]


@pytest.mark.cuda_emulated
@pytest.mark.extended  # CI time
@pytest.mark.parametrize("runs", [2], indirect=True)
def test_on_emulated_cuda_every_getter_and_setter_as_on_the_cpu(runs, tmp_path):
    """safe_get_full_* / safe_set_full_* on an emulated CUDA device under NCCL's rules (tests/helpers/
    emulated_cuda.py): every value read, every refusal and the training the setters changed are the CPU run's."""
    n, load = runs
    run_ranks([os.path.join(WORKERS, "full_tensor_worker.py"), str(tmp_path), *EMULATED_CASES], n, env=EMULATED)
    for case in EMULATED_CASES:
        for rank in range(n):
            ours, reference = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt"), load(case, rank)
            assert ours.keys() == reference.keys(), case
            for key in ("losses", "refusals", "set_read_back", "model_unchanged_by_set", "split", "frozen_is_none"):
                assert ours[key] == reference[key], (case, key)
            for key in ("params", "seen"):
                assert ours[key].keys() == reference[key].keys(), (case, key)
                assert all(torch.equal(ours[key][k].cpu(), v) for k, v in reference[key].items()), (case, key)
