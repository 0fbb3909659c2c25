"""Beyond pure data parallelism, with real ranks: tensor parallelism through an ``mpu`` (2 tensor-parallel x
2 data-parallel ranks) and DeepSpeed's AutoTP (the same layout), pipeline parallelism (2 stages x 1 and 2
data-parallel ranks, 2 x 3 behind ``-m scale``) and Ulysses sequence parallelism (2 x 2).

TPGPT (tp_model.py) has column- and row-parallel linears and replicated norms; with the same ``mpu``
ds_tensorshard must train exactly as stock ZeRO-1/2 (the global norm counts every tensor-parallel
shard once and replicated tensors once), save one file set per model-parallel rank with stock's
names, resume at another data-parallel size, and convert to and from stock ZeRO checkpoints.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import ACROSS_WORLDS, TOLERANCE, assert_run_matches
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env, run_cli, run_in_group, run_ranks

WORKER = os.path.join(WORKERS, "tp_worker.py")

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

CASES = [f"{d}:{m}:{s}" for d in ("fp32", "bf16") for m in ("stock", "ts") for s in (1, 2)]
STRIPES = ["fp32:ts-stripes:2"]  # bucket_layout "stripes" beside the windows


def as_run(result: dict) -> dict:
    return {"losses": [result["losses"][k] for k in sorted(result["losses"])], "params": result["params"]}


FP32_CASES = [c for c in CASES if c.startswith("fp32:")]
TP_WIDE = [c for c in CASES if c.startswith("bf16:ts:")] + ["fp32:tsmpi:2", "fp32:tsmpi:1"]  # -m extended: CI time


def model_parallel_runs(worker: str, out, cases: list[str], mpi_cases: list[str]):
    """``worker``'s ``cases`` at 2 model-parallel x 2 data-parallel ranks, ``mpi_cases`` under mpiexec."""
    run_ranks([worker, str(out), "2", *cases], 4)
    if mpi_cases:
        port = free_port()
        proc = run_in_group(
            [MPIEXEC, "-n", "4", sys.executable, "-m", "mpi4py", worker, str(out), "2", *mpi_cases],
            env={**launcher_env(), "MASTER_PORT": str(port)},
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lambda case, rank: torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt")


def tp_runs(out, cases: list[str], mpi_cases: list[str]):
    """tp_worker.py's runs at 2 tensor x 2 data-parallel ranks."""
    return model_parallel_runs(WORKER, out, cases, mpi_cases)


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    return tp_runs(tmp_path_factory.mktemp("tp"), [*FP32_CASES, *STRIPES], [])


@pytest.fixture(scope="module")
def tp_wide(tmp_path_factory):
    """bf16 and the mpi transport (-m extended, CI time)."""
    bf16 = [c for c in CASES if c.startswith("bf16:")]
    return tp_runs(tmp_path_factory.mktemp("tp_wide"), bf16, ["fp32:tsmpi:2", "fp32:tsmpi:1"])


TP_CASES = (
    [c for c in FP32_CASES if ":ts:" in c] + STRIPES + [pytest.param(c, marks=pytest.mark.extended) for c in TP_WIDE]
)


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_trains_as_stock_with_the_same_mpu(request, case):
    runs = request.getfixturevalue("tp_wide" if case in TP_WIDE else "tp")
    dtype, _, stage = case.split(":")
    stock_runs = request.getfixturevalue("tp" if dtype == "fp32" else "tp_wide")  # stock fp32 runs in `tp`
    for rank in range(4):
        ours, stock = runs(case, rank), stock_runs(f"{dtype}:stock:{stage}", rank)
        assert ours["optimizer_class"] == "TensorShardOptimizer"
        assert_run_matches(as_run(ours), as_run(stock), dtype, f"{case} rank {rank}")
        for step, norm in stock["norms"].items():  # the model-parallel norm rule
            assert abs(ours["norms"][step] - norm) <= TOLERANCE["fp32"]["norm"] * norm, (case, rank, step)


def test_tensor_parallel_ranks_hold_their_shards_and_the_same_replicas(tp):
    ranks = [tp("fp32:ts:2", r)["params"] for r in range(4)]  # rank = dp * 2 + tp
    assert torch.equal(ranks[0]["blocks.0.ln.weight"], ranks[1]["blocks.0.ln.weight"])  # replicated
    assert not torch.equal(ranks[0]["blocks.0.fc_weight"], ranks[1]["blocks.0.fc_weight"])  # shards differ
    assert torch.equal(ranks[0]["blocks.0.fc_weight"], ranks[2]["blocks.0.fc_weight"])  # data-parallel copies


AUTOTP_CASES = [f"{d}:{s}" for d in ("fp32", "bf16") for s in (1, 2)]


@pytest.mark.extended  # CI time (27 s): -m extended; TP with an mpu stays in the default suite
def test_autotp_trains_as_stock_with_the_same_config(tmp_path):
    """DeepSpeed's AutoTP (``tensor_parallel.autotp_size`` 2 with ``partition_config`` patterns; the engine shards
    the model's linears itself) at 2 tensor-parallel x 2 data-parallel ranks, stages 1 and 2, fp32 and bf16: stock
    ZeRO-1/2 and ds_tensorshard with the same config. Measured: losses equal; bf16 parameters bit-identical, fp32
    within 1.5e-8 (the norm, above the clipping threshold, is 1 fp32 ulp off: the clip factor's last bit). Saved
    after 3 steps (a file set per model-parallel rank, stock's names) and resumed in a new engine: bit-identical to
    the uninterrupted run."""
    cases = [f"{d}:{m}:{s}" for d, s in (c.split(":") for c in AUTOTP_CASES) for m in ("stock", "ts")]
    cases += ["fp32:ts-resume:2", "bf16:ts-resume:1"]
    run_ranks([os.path.join(WORKERS, "autotp_worker.py"), str(tmp_path), "2", *cases], 4)
    load = lambda case, rank: torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt")  # noqa: E731
    for case in AUTOTP_CASES:
        dtype, stage = case.split(":")
        runs = [(load(f"{dtype}:ts:{stage}", r), load(f"{dtype}:stock:{stage}", r)) for r in range(4)]
        for rank, (ours, stock) in enumerate(runs):
            assert ours["optimizer_class"] == "TensorShardOptimizer" and "LinearAllreduce" in ours["tp_layers"]
            assert_run_matches(ours, stock, dtype, f"autotp {case} rank {rank}")
            assert ours["losses"] == stock["losses"], (case, rank)
            if dtype == "bf16":
                assert all(torch.equal(ours["params"][k], v) for k, v in stock["params"].items()), (case, rank)
        shards = [ours["params"] for ours, _ in runs]  # rank = dp * 2 + tp
        assert not torch.equal(shards[0]["blocks.0.up.weight"], shards[1]["blocks.0.up.weight"])  # its shards
        assert torch.equal(shards[0]["blocks.0.up.weight"], shards[2]["blocks.0.up.weight"])  # data-parallel copies
        assert torch.equal(shards[0]["head.weight"], shards[1]["head.weight"])  # replicated
    for case in ("fp32:ts-resume:2", "bf16:ts-resume:1"):  # a save per model-parallel rank, loaded back: exact
        dtype, _, stage = case.split(":")
        for rank in range(4):
            resumed, whole = load(case, rank), load(f"{dtype}:ts:{stage}", rank)
            assert resumed["losses"] == whole["losses"], (case, rank)
            assert all(torch.equal(resumed["params"][k], v) for k, v in whole["params"].items()), (case, rank)
    assert sorted(p.name for p in (tmp_path / "ckpt_fp32_2").glob("*/[!.]*.pt")) == [
        *(f"mp_rank_0{m}_model_states.pt" for m in range(2)),
        *(f"zero_pp_rank_{d}_mp_rank_0{m}_optim_states.pt" for d in range(2) for m in range(2)),
    ]


def train(out, world, *args):
    run_ranks([WORKER, str(out), "2", *map(str, args)], world)
    return [torch.load(out / f"{args[0].replace(':', '_')}.rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_ckpt")
    runs = {"dir": d}
    for name in ("ref", "l21", "stock", "ls21", "lz21"):
        (d / name).mkdir()
    runs["ref"] = train(d / "ref", 4, "fp32:ts:2", "--save", d / "c")  # 2 tp x 2 dp, saved at step 3
    runs["2to1"] = train(d / "l21", 2, "fp32:ts:2", "--load", d / "c")  # 2 tp x 1 dp
    runs["stock"] = train(d / "stock", 4, "fp32:stock:2", "--save", d / "s")
    runs["stock2to1"] = train(d / "ls21", 2, "fp32:ts:2", "--load", d / "s")
    proc = run_cli("convert-checkpoint", d / "c", d / "z", "--to", "zero", "--world-size", 1)
    assert proc.returncode == 0, proc.stderr
    runs["zero2to1"] = train(d / "lz21", 2, "fp32:stock:2", "--load", d / "z")
    return runs


def assert_resumed(resumed: list[dict], reference: list[dict]) -> None:
    for tp_rank, ours in enumerate(resumed):  # data-parallel rank 0 of each tensor-parallel rank
        ref = reference[tp_rank]
        assert sorted(ours["losses"]) == [3, 4, 5]
        for step, loss in ours["losses"].items():
            assert abs(loss - ref["losses"][step]) <= ACROSS_WORLDS["fp32"]["loss"], (tp_rank, step)
        for name, value in ref["params"].items():
            atol = ACROSS_WORLDS["fp32"]["param"]
            torch.testing.assert_close(ours["params"][name], value, rtol=0, atol=atol, msg=name)


@pytest.mark.extended  # CI time: tp_checkpoints is five launches (71 s); TP training itself stays in the default suite
def test_files_per_model_parallel_rank_with_stocks_names(tp_checkpoints):
    names = sorted(os.listdir(tp_checkpoints["dir"] / "c" / "step3"))
    for mp in (0, 1):
        assert f"mp_rank_{mp:02d}_model_states.pt" in names
        for dp in (0, 1):
            assert f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" in names


@pytest.mark.extended  # CI time, as above
@pytest.mark.parametrize("resumed", ["2to1", "stock2to1", "zero2to1"])
def test_resume_at_another_data_parallel_size_with_the_same_tensor_parallel_size(tp_checkpoints, resumed):
    reference = tp_checkpoints["stock" if resumed == "stock2to1" else "ref"]
    assert_resumed(tp_checkpoints[resumed], reference)


PIPE = os.path.join(WORKERS, "pipe_worker.py")


def pipe_runs(out, world, *args) -> dict[int, dict]:
    """Run pipe_worker.py on ``world`` ranks; returns each stage's result of data-parallel rank 0, by case."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks([PIPE, str(out), *map(str, args)], world)
    cases = [a for a in args if ":" in str(a)]
    return {
        case: {
            torch.load(out / f"{case.replace(':', '_')}.rank{r}.pt")["stage"]: torch.load(
                out / f"{case.replace(':', '_')}.rank{r}.pt"
            )
            for r in range(world)
        }
        for case in cases
    }


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """fp32 at 2 stages x 2 data-parallel ranks, stock's and ours, ours saved and resumed at that layout."""
    d = tmp_path_factory.mktemp("pipe")
    runs = pipe_runs(d / "2x2", 4, "fp32:stock", "fp32:ts", "--save", d / "c")
    runs["resumed 2x2"] = pipe_runs(d / "r22", 4, "fp32:ts", "--load", d / "c")["fp32:ts"]
    runs["checkpoint"] = d / "c"
    return runs


@pytest.fixture(scope="module")
def pipeline_wide(pipeline, tmp_path_factory):
    """bf16, stripes, one data-parallel rank and the resume at it (-m extended, CI time)."""
    d = tmp_path_factory.mktemp("pipe_wide")
    runs = pipe_runs(d / "2x2", 4, "bf16:stock", "bf16:ts", "fp32:ts-stripes")
    runs["2x1"] = pipe_runs(d / "2x1", 2, "fp32:stock", "fp32:ts")
    runs["resumed 2x1"] = pipe_runs(d / "r21", 2, "fp32:ts", "--load", pipeline["checkpoint"])["fp32:ts"]
    return runs


def assert_stages_match(
    ours: dict, stock: dict, dtype: str, where: str, first_step: int = 0, param_atol: float | None = None
) -> None:
    for stage, result in ours.items():
        ref = stock[stage]
        assert sorted(result["losses"]) == list(range(first_step, 6)), where
        losses = [result["losses"][k] for k in sorted(result["losses"])]
        ref_losses = [ref["losses"][k] for k in sorted(result["losses"])]
        run = lambda r, ls: {"losses": ls, "params": r["params"]}  # noqa: E731
        if param_atol is None:
            assert_run_matches(run(result, losses), run(ref, ref_losses), dtype, f"{where} stage {stage}")
        else:
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=ACROSS_WORLDS["fp32"]["loss"]
            )
            for name, value in ref["params"].items():
                torch.testing.assert_close(result["params"][name], value, rtol=0, atol=param_atol, msg=name)


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.extended)])
def test_pipeline_trains_as_stock_pipeline_engine_with_zero1(request, dtype):
    runs = request.getfixturevalue("pipeline" if dtype == "fp32" else "pipeline_wide")
    ours = runs[f"{dtype}:ts"]
    assert {r["optimizer_class"] for r in ours.values()} == {"TensorShardOptimizer"} and sorted(ours) == [0, 1]
    assert "tied_modules.embed.weight" in ours[0]["params"] and "tied_modules.embed.weight" in ours[1]["params"]
    assert_stages_match(ours, runs[f"{dtype}:stock"], dtype, f"{dtype} 2 stages x 2 data-parallel")
    assert torch.equal(ours[0]["params"]["tied_modules.embed.weight"], ours[1]["params"]["tied_modules.embed.weight"])


@pytest.mark.extended  # CI time: pipeline_wide's launches
def test_pipeline_with_stripes_trains_as_stock(pipeline, pipeline_wide):
    ours = pipeline_wide["fp32:ts-stripes"]
    assert {r["optimizer_class"] for r in ours.values()} == {"TensorShardOptimizer"} and sorted(ours) == [0, 1]
    assert_stages_match(ours, pipeline["fp32:stock"], "fp32", "stripes, 2 stages x 2 data-parallel")


@pytest.mark.extended  # CI time: pipeline_wide's launches
def test_pipeline_with_one_data_parallel_rank_trains_as_stock(pipeline_wide):
    assert_stages_match(pipeline_wide["2x1"]["fp32:ts"], pipeline_wide["2x1"]["fp32:stock"], "fp32", "2 stages x 1")


def test_pipeline_resumes_exactly(pipeline):
    reference = pipeline["fp32:ts"]
    for stage, resumed in pipeline["resumed 2x2"].items():  # same layout: bit for bit
        assert resumed["losses"] == {k: v for k, v in reference[stage]["losses"].items() if k >= 3}
        assert all(torch.equal(resumed["params"][k], v) for k, v in reference[stage]["params"].items())


@pytest.mark.extended  # CI time: pipeline_wide's launches
def test_pipeline_resumes_at_another_data_parallel_size(pipeline, pipeline_wide):
    # another data-parallel size sums gradients in another order: stock itself moves these parameters by
    # up to 1.7e-4 between 2 x 1 and 2 x 3 data-parallel runs (measured), so parameters are held to 5e-4
    assert_stages_match(
        pipeline_wide["resumed 2x1"], pipeline["fp32:ts"], "fp32", "resumed at 2 x 1", first_step=3, param_atol=5e-4
    )


@pytest.mark.scale
def test_pipeline_at_three_data_parallel_ranks(tmp_path):
    runs = pipe_runs(tmp_path / "save", 4, "fp32:ts", "--save", tmp_path / "c")
    wide = pipe_runs(tmp_path / "2x3", 6, "fp32:stock", "fp32:ts")
    # at 3 data-parallel ranks the sum rounds in another order than stock's; the attention's key bias has an
    # exactly-zero true gradient, so Adam turns that rounding noise into lr-sized steps (7.5e-5 measured)
    assert_stages_match(wide["fp32:ts"], wide["fp32:stock"], "fp32", "2 stages x 3", param_atol=5e-4)
    resumed = pipe_runs(tmp_path / "r23", 6, "fp32:ts", "--load", tmp_path / "c")["fp32:ts"]
    assert_stages_match(resumed, runs["fp32:ts"], "fp32", "resumed at 2 x 3", first_step=3, param_atol=5e-4)


def sp_runs(out, cases: list[str], mpi_cases: list[str]):
    """sp_worker.py's runs at 2 sequence x 2 data-parallel ranks."""
    return model_parallel_runs(os.path.join(WORKERS, "sp_worker.py"), out, cases, mpi_cases)


@pytest.fixture(scope="module")
def ulysses(tmp_path_factory):
    cases = [f"fp32:{m}:{s}" for m in ("stock", "ts") for s in (1, 2)]
    return sp_runs(tmp_path_factory.mktemp("sp"), [*cases, *STRIPES], [])


@pytest.fixture(scope="module")
def ulysses_wide(tmp_path_factory):
    """bf16 and the mpi transport (-m extended, CI time)."""
    cases = [f"bf16:{m}:{s}" for m in ("stock", "ts") for s in (1, 2)]
    return sp_runs(tmp_path_factory.mktemp("sp_wide"), [*cases, "fp32:stock:2"], ["fp32:tsmpi:2"])


SP_WIDE = [f"bf16:ts:{s}" for s in (1, 2)] + ["fp32:tsmpi:2"]
SP_CASES = [f"fp32:ts:{s}" for s in (1, 2)] + STRIPES + [pytest.param(c, marks=pytest.mark.extended) for c in SP_WIDE]


@pytest.mark.parametrize("case", SP_CASES)
def test_ulysses_sequence_parallel_matches_stock(request, case):
    """Same divisor (data-parallel size, sequence shards add up) and communication dtype (fp32) as stock. At
    4 reducing ranks fp32 sums round in another order than stock's: the attention's key bias (true gradient
    zero) then moves by up to 1.5e-4 (measured); every other parameter within the fp32 tolerance."""
    ulysses = request.getfixturevalue("ulysses_wide" if case in SP_WIDE else "ulysses")
    dtype, _, stage = case.split(":")
    for rank in range(4):
        ours, stock = ulysses(case, rank), ulysses(f"{dtype}:stock:{stage}", rank)
        assert ours["optimizer_class"] == "TensorShardOptimizer"
        assert ours["communication_dtype"] == stock["communication_dtype"] == "torch.float32"
        assert_run_matches(ours, stock, dtype, f"{case} rank {rank}", loose={"qkv.bias": 5e-4})
