"""Scale: an embedding larger than a rank's share, so ``split_tensors: "auto"`` owns it in dim-0 blocks.

TinyGPT with a 1,024-token vocabulary (its 32,768-element embedding is 55% of the model) at 4 ranks
(8 ranks behind the ``scale`` marker): the same losses and parameters as stock ZeRO-1/2 with the
embedding split (``"auto"``) and whole (``"never"``), on both transports, fp32 and bf16; buffers
bounded by the bucket size; reductions under way before backward reaches the embedding; and
checkpoints that resume across a change of plan (split <-> whole, 3 <-> 2 ranks; 8 <-> 3 ranks
behind the marker), convert to stock ZeRO and to fp32 weights.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import ACROSS_WORLDS, assert_cases_match
from tests.helpers.ranks import TIMEOUT_S, free_port, launcher_env, run_cli, run_in_group, run_ranks
from tests.workers.checkpoint_worker import command

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
VOCAB = {"EQ_VOCAB": "1024"}
BUCKET = 3000  # zero_optimization.reduce_bucket_size of the equivalence configs
TORCH_CASES = [f"{d}:{c}" for d in ("fp32", "bf16") for c in ("stock:2", "stock:1", "ts:2", "ts:2:never", "ts:1")]
MPI_CASES = [
    f"{d}:{c}" for d in ("fp32", "bf16") for c in ("stock:2", "tsmpi:2", "tsmpi:2:never", "stock:1", "tsmpi:1")
]
PAIRS = [
    (f"{d}:{ts}", f"{d}:stock:{ts.split(':')[1]}") for d in ("fp32", "bf16") for ts in ("ts:2", "ts:2:never", "ts:1")
]


def launch(n: int, transport: str, out) -> None:
    worker = os.path.join(WORKERS, "equivalence_worker.py")
    if transport == "torch":
        run_ranks([worker, str(out), *TORCH_CASES], n, env=VOCAB)
        return
    port = free_port()
    proc = run_in_group(
        [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", worker, str(out), *MPI_CASES],
        env={**launcher_env(), **VOCAB, "MASTER_PORT": str(port)},
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def world_params():
    return [
        pytest.param((4, "torch"), id="4-torch"),
        pytest.param((4, "mpi"), id="4-mpi", marks=pytest.mark.extended),
        pytest.param((8, "torch"), id="8-torch", marks=pytest.mark.scale),
        pytest.param((8, "mpi"), id="8-mpi", marks=pytest.mark.scale),
    ]


@pytest.fixture(scope="module", params=world_params())
def scaled(request, tmp_path_factory):
    n, transport = request.param
    out = tmp_path_factory.mktemp(f"scale{n}{transport}")
    launch(n, transport, out)
    return n, transport, lambda case, rank: torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt")


def ours(case: str, transport: str) -> str:
    return case.replace(":ts:", ":tsmpi:") if transport == "mpi" else case


def test_same_losses_and_parameters_as_stock_split_or_whole(scaled):
    n, transport, load = scaled
    assert_cases_match(load, n, [(ours(case, transport), reference) for case, reference in PAIRS])


def test_auto_splits_the_embedding_and_balances_never_keeps_it_whole(scaled):
    n, transport, load = scaled
    for dtype in ("fp32", "bf16"):
        auto, never = load(ours(f"{dtype}:ts:2", transport), 0), load(ours(f"{dtype}:ts:2:never", transport), 0)
        total = sum(auto["numel_per_rank"])
        assert len(auto["blocks"]["wte.weight"]) >= 2
        assert max(auto["numel_per_rank"]) <= 1.02 * total / n
        assert all(len(blocks) == 1 for blocks in never["blocks"].values())
        assert max(never["numel_per_rank"]) == auto["params"]["wte.weight"].numel() > 1.02 * total / n
        for rank in range(n):  # optimizer state for owned elements only
            result = load(ours(f"{dtype}:ts:2", transport), rank)
            assert result["master_numel"] == result["numel_per_rank"][rank]
            assert result["state_numel"] == 2 * result["numel_per_rank"][rank]
            assert result["largest_buffer"] <= BUCKET


def test_reductions_run_before_backward_reaches_the_embedding(scaled):
    n, transport, load = scaled
    for rank in range(n):
        result = load(ours("fp32:ts:2", transport), rank)
        first = result["first_embedding_bucket"]  # buckets follow backward's order from the second backward on
        assert 0 < first < result["buckets"]
        assert all(started >= first for started in result["started_at_embedding"][1:]), result["started_at_embedding"]


# -- checkpoints across a change of plan --------------------------------------------------------

CHECKPOINT = os.path.join(WORKERS, "checkpoint_worker.py")
CKPT_ENV = {**VOCAB, "CKPT_GLOBAL_BATCH": "24"}
FP32 = ACROSS_WORLDS["fp32"]  # resumes at another world size (compare.py)


def train(out, world, *extra, stage=2, mode="ts"):
    run_ranks([CHECKPOINT, str(out), "fp32", mode, str(stage), "6", *map(str, extra)], world, env=CKPT_ENV)
    return torch.load(out)


def assert_continues(resumed, reference, first_step=3):
    assert sorted(resumed["losses"]) == list(range(first_step, 6))
    for step, loss in resumed["losses"].items():
        assert abs(loss - reference["losses"][step]) <= FP32["loss"], (step, loss, reference["losses"][step])
    for name, value in reference["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=FP32["param"], msg=name)


def cli(*args):
    proc = run_cli(*args, env={**os.environ, **CKPT_ENV})
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def split_checkpoints(tmp_path_factory):
    """Three launches: at 2 ranks a save with the embedding whole; at 3 ranks a save with it split (auto) and the
    2-rank save resumed split; at 2 ranks the 3-rank save resumed whole, and stock ZeRO-2 resuming its conversion."""
    d = tmp_path_factory.mktemp("split_ckpt")

    def run(name, *extra, mode="ts"):
        return (d / f"{name}.pt", "fp32", mode, 2, 6, *extra)

    run_ranks(command(run("w2", "--save", d / "c2", "--save-at", 3, "--split", "never")), 2, env=CKPT_ENV)
    run_ranks(command(run("s3", "--save", d / "c3", "--save-at", 3), run("l23", "--load", d / "c2")), 3, env=CKPT_ENV)
    cli("convert-checkpoint", d / "c3", d / "c3_as_zero", "--to", "zero", "--world-size", 2)
    resumed = run("l32", "--load", d / "c3", "--split", "never")
    run_ranks(command(resumed, run("lsz", "--load", d / "c3_as_zero", mode="stock")), 2, env=CKPT_ENV)
    cli("convert-checkpoint", d / "c3", d / "split.fp32.pt", "--to", "fp32")
    cli("convert-checkpoint", d / "c3_as_zero", d / "zero.fp32.pt", "--to", "fp32")
    names = {"split3": "s3", "whole2": "w2", "3to2whole": "l32", "2to3split": "l23", "stock_from_split": "lsz"}
    return {"dir": d, **{key: torch.load(d / f"{name}.pt") for key, name in names.items()}}


@pytest.mark.extended  # CI time (split_checkpoints' launches, 47 s; split training stays): -m extended
def test_split_checkpoint_is_split_on_disk(split_checkpoints):
    from ds_tensorshard.checkpoints.files import load

    folder = split_checkpoints["dir"] / "c3" / "step3"
    entries = [
        load(str(folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]["tensors"]
        for r in range(3)
    ]
    blocks = [e["wte.weight"]["block"] for e in entries if "wte.weight" in e]
    assert len(blocks) >= 2 and sorted(b[0] for b in blocks)[0] == 0


@pytest.mark.extended  # CI time (as above): -m extended
@pytest.mark.parametrize("resumed,reference", [("3to2whole", "split3"), ("2to3split", "whole2")])
def test_resume_across_a_change_of_plan_matches_the_uninterrupted_run(split_checkpoints, resumed, reference):
    assert_continues(split_checkpoints[resumed], split_checkpoints[reference])


@pytest.mark.extended  # CI time (as above): -m extended
def test_split_checkpoint_converts_to_stock_zero_and_fp32(split_checkpoints):
    d = split_checkpoints["dir"]
    assert_continues(split_checkpoints["stock_from_split"], split_checkpoints["split3"])
    split, zero = torch.load(d / "split.fp32.pt"), torch.load(d / "zero.fp32.pt")
    assert split.keys() == zero.keys() and all(torch.equal(split[k], zero[k]) for k in split)
    from tests.helpers.tiny_gpt import TinyGPT

    TinyGPT(vocab=1024, seq=16).load_state_dict(split, strict=True)


@pytest.mark.scale
def test_resume_8_to_3_and_3_to_8_across_a_split(tmp_path):
    ref8 = train(tmp_path / "r8.pt", 8, "--save", tmp_path / "c8", "--save-at", 3)
    ref3 = train(tmp_path / "r3.pt", 3, "--save", tmp_path / "c3", "--save-at", 3)
    assert_continues(train(tmp_path / "l83.pt", 3, "--load", tmp_path / "c8"), ref8)
    assert_continues(train(tmp_path / "l38.pt", 8, "--load", tmp_path / "c3"), ref3)


@pytest.fixture(scope="module")
def stage3_split(tmp_path_factory):
    """ZeRO stage 3 with the embedding owned in dim-0 blocks at 3 ranks, trained (its masters in blocks) and frozen
    (its owners' blocks of the parameter itself), saved at step 3 and resumed at 2 ranks at stage 3 and stage 2."""
    d = tmp_path_factory.mktemp("stage3_split")
    runs = {"trained": (), "frozen": ("--freeze-embedding",)}

    def run(name, stage, *extra):
        return (d / f"{name}.pt", "fp32", "ts", stage, 6, "--persistence", 0, *extra)

    saves = [run(f"{k}3", 3, *flag, "--save", d / k, "--save-at", 3) for k, flag in runs.items()]
    run_ranks(command(*saves), 3, env=CKPT_ENV)
    resumes = [run(f"{k}3to2s{s}", s, *flag, "--load", d / k) for k, flag in runs.items() for s in (3, 2)]
    run_ranks(command(*resumes), 2, env=CKPT_ENV)
    return {"dir": d, **{p.stem: torch.load(p) for p in d.glob("*.pt")}}


@pytest.mark.extended  # CI time: two launches at vocabulary 1024
@pytest.mark.parametrize("kind", ["trained", "frozen"])
def test_stage3_blocks_are_saved_as_blocks_and_resume_at_another_world_size_and_stage(stage3_split, kind):
    from ds_tensorshard.checkpoints.files import load

    folder = stage3_split["dir"] / kind / "step3"
    section = "tensors" if kind == "trained" else "parameters"
    files = [
        load(str(folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"] for r in range(3)
    ]
    blocks = sorted(f[section]["wte.weight"]["block"] for f in files if "wte.weight" in f[section])
    assert len(blocks) >= 2 and blocks[0][0] == 0 and blocks[-1][1] == 1024 * 32, blocks
    for stage in (3, 2):
        assert_continues(stage3_split[f"{kind}3to2s{stage}"], stage3_split[f"{kind}3"])
