"""DeepSpeed releases (``-m versions``): the oldest and newest release of each series 0.16-0.19, each in its
own venv with torch 2.13.0 (tests/helpers/venvs.py makes .venv-dsX.Y.Z on first use; 0.19.8 is this venv).

- ``import ds_tensorshard`` accepts each of them (the range in setup.cfg and ds_tensorshard/versions.py).
- PyTorch-style backward (``loss.backward()``, fp32 ZeRO-2) against stock of the release from 0.18.5 on, and its
  refusal, naming the release, before.
- The equivalence cases (fp32, bf16, fp16 x stages 1 and 2, 2 ranks) against stock ZeRO of the same
  release, and checkpoints (ds_tensorshard saved on 2 ranks resumed on 3; a stock ZeRO checkpoint of that
  release resumed by ds_tensorshard) against the uninterrupted runs. Where a release's stock ZeRO is
  broken (measured, see :data:`STOCK_ZERO2_BUG` and :data:`STOCK_BROKEN`) the reference is named in the
  test: stock ZeRO-1 of the release, or 0.19.8's stock ZeRO; fp16 is refused where nothing stock matches.
  ``VERSIONS_OUT=FILE`` appends one JSON line per release with the outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.compare import ACROSS_WORLDS, assert_run_matches
from tests.helpers.ranks import TIMEOUT_S, free_port, rank_env
from tests.helpers.venvs import DEEPSPEED_RELEASES, SPECS, RegistryUnreachable, build_fused_adam, ensure, venv_env
from tests.workers.equivalence_worker import CASES

pytestmark = pytest.mark.versions
NEWEST = "0.19.8"  # this venv
RELEASES = [r for r in DEEPSPEED_RELEASES if r != NEWEST] + [NEWEST]
FP32 = ACROSS_WORLDS["fp32"]  # checkpoint round trips at another world size (compare.py)
# deepspeed#7718 (0.17.6 <= release < 0.18.3): stock ZeRO-2 accumulates wrong gradients; its ZeRO-1 is right
STOCK_ZERO2_BUG = {"0.17.6", "0.18.0"}
# stock ZeRO-1/2 of the release cannot run with torch 2.13: 0.19.8's stock ZeRO is the reference
STOCK_BROKEN = {
    "0.18.9": "runtime/utils.py all_gather_into_tensor_dp_groups writes into a view of torch.split "
    "('Output 0 of Split is a view and is being modified inplace')"
}


def interpreter(release: str) -> tuple[str, dict]:
    """The python of ``release``'s venv and its environment (its own torch extension cache)."""
    if release == NEWEST:
        return sys.executable, dict(os.environ)
    try:
        spec = ensure(SPECS[f"ds{release}"])
    except RegistryUnreachable as err:
        pytest.skip(f"deepspeed {release}: {err}")
    build_fused_adam(spec)
    return spec.python, venv_env(spec, os.environ)


def ranks(python: str, env: dict, args: list[str], world: int) -> None:
    """Run ``python ARGS`` as ``world`` ranks; every rank must exit 0."""
    procs, outputs = start(python, env, args, world)
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} of {args[:2]} exited {p.returncode}:\n{out[-5000:]}"


def start(python: str, env: dict, args: list[str], world: int) -> tuple[list[subprocess.Popen], list[str]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [python, *args],
            env=rank_env(r, world, port, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outputs


def record(release: str, **facts) -> None:
    if os.environ.get("VERSIONS_OUT"):
        with open(os.environ["VERSIONS_OUT"], "a") as f:
            f.write(json.dumps({"deepspeed": release, **facts}) + "\n")


def stale_norms_on_overflow(run: dict) -> dict:
    """0.19.8's stock reports an overflow step's grad norm as inf; before 0.19.8 stock (and ds_tensorshard)
    keeps the last finite norm (0 before any)."""
    norms, last = [], 0.0
    for norm in run["norms"]:
        last = last if norm == float("inf") else norm
        norms.append(last)
    return {**run, "norms": norms}


@pytest.mark.parametrize("release", RELEASES)
def test_import_check(release):
    python, env = interpreter(release)
    env.pop("DS_TENSORSHARD_UNTESTED_DEEPSPEED", None)
    proc = subprocess.run(
        [python, "-W", "error::UserWarning:ds_tensorshard", "-c", "import ds_tensorshard"],
        env={**env, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    record(release, check="import", ok=proc.returncode == 0)
    assert proc.returncode == 0, proc.stderr[-3000:]


def references(release: str) -> dict[str, str]:
    """The stock case each ds_tensorshard case of ``release`` is held to."""
    refs = {}
    for case in CASES:
        dtype, mode, stage = case.split(":")
        if mode != "ts":
            continue
        if dtype == "fp16" and fp16_refused(release, int(stage)):
            continue
        stock_stage = "1" if release in STOCK_ZERO2_BUG else stage
        refs[case] = f"{dtype}:stock:{stock_stage}"
    return refs


def direct_backward_refused(version: str) -> bool:
    from ds_tensorshard.datapath.backward_check import direct_backward_refusal
    from ds_tensorshard.versions import release

    return direct_backward_refusal(release(version)) is not None


def fp16_refused(version: str, stage: int) -> bool:
    from ds_tensorshard.versions import fp16_refusal, release

    return fp16_refusal(stage, release(version)) is not None


@pytest.mark.parametrize("release", RELEASES)
def test_equivalence_and_checkpoints(release, tmp_path):
    python, env = interpreter(release)
    # stock ZeRO runs in the release's venv unless it cannot run with this torch (then 0.19.8's)
    stock_python, stock_env = (sys.executable, dict(os.environ)) if release in STOCK_BROKEN else (python, env)
    refs = references(release)
    equivalence = [os.path.join(WORKERS, "equivalence_worker.py"), str(tmp_path)]
    ranks(python, env, [*equivalence, *refs], 2)
    ranks(stock_python, stock_env, [*equivalence, *set(refs.values())], 2)
    worst = {}
    for case, ref in refs.items():
        dtype = case.split(":")[0]
        for rank in range(2):
            ours = torch.load(tmp_path / f"{case.replace(':', '_')}.rank{rank}.pt")
            stock = torch.load(tmp_path / f"{ref.replace(':', '_')}.rank{rank}.pt")
            assert ours["optimizer_class"] == "TensorShardOptimizer"
            assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer"
            if release in STOCK_BROKEN:  # the reference is 0.19.8's: its overflow norm convention is newer
                stock = stale_norms_on_overflow(stock)
            assert_run_matches(ours, stock, dtype, f"deepspeed {release} {case} against {ref} rank {rank}")
            worst[case] = max(worst.get(case, 0.0), *(abs(a - b) for a, b in zip(ours["losses"], stock["losses"])))

    if release in STOCK_ZERO2_BUG:  # the upstream bug is there: stock ZeRO-2 leaves stock ZeRO-1
        ranks(python, env, [*equivalence, "fp32:stock:2"], 2)
        zero1, zero2 = (torch.load(tmp_path / f"fp32_stock_{s}.rank0.pt") for s in (1, 2))
        assert max(abs(a - b) for a, b in zip(zero1["losses"], zero2["losses"])) > 1e-3, release
    for stage in (1, 2):
        if fp16_refused(release, stage):
            procs, outputs = start(python, env, [*equivalence, f"fp16:ts:{stage}"], 2)
            assert all(p.returncode != 0 for p in procs)
            refusal = f"'fp16.enabled' with ZeRO stage {stage} is refused on deepspeed {release}"
            assert refusal in outputs[0], outputs[0][-3000:]

    # PyTorch-style backward: as stock where the engine runs its end (0.18.5 on), else refused at its first gradient
    features, direct = [os.path.join(WORKERS, "feature_worker.py"), str(tmp_path)], "torch_backward_fp32_stage2"
    if direct_backward_refused(release):
        procs, outputs = start(python, env, [*features, f"{direct}:ts"], 2)
        assert all(p.returncode != 0 for p in procs)
        refusal = f"loss.backward() was called directly, not through engine.backward(loss), on deepspeed {release}: "
        assert refusal in outputs[0], outputs[0][-3000:]
    else:
        ranks(python, env, [*features, f"{direct}:ts"], 2)
        ranks(stock_python, stock_env, [*features, f"{direct}:stock"], 2)
        for rank in range(2):
            ours, stock = (torch.load(tmp_path / f"{direct}_{mode}.rank{rank}.pt") for mode in ("ts", "stock"))
            assert_run_matches(ours, stock, "fp32", f"deepspeed {release} {direct} rank {rank}")

    worker = os.path.join(WORKERS, "checkpoint_worker.py")

    def train(name: str, mode: str, world: int, *extra, stage: str = "2", stock: bool = False) -> dict:
        py, ev = (stock_python, stock_env) if stock else (python, env)
        ranks(py, ev, [worker, str(tmp_path / f"{name}.pt"), "fp32", mode, stage, "6", *map(str, extra)], world)
        return torch.load(tmp_path / f"{name}.pt")

    stock_stage = "1" if release in STOCK_ZERO2_BUG else "2"
    reference = train("ref2", "ts", 2, "--save", tmp_path / "c2", "--save-at", 3)
    resumed = train("l23", "ts", 3, "--load", tmp_path / "c2")
    stock = train("s2", "stock", 2, "--save", tmp_path / "s2", "--save-at", 3, stage=stock_stage, stock=True)
    from_stock = train("ls22", "ts", 2, "--load", tmp_path / "s2", stage=stock_stage)
    checks = (("resume 2->3", resumed, reference), (f"stock ZeRO-{stock_stage} -> ds_tensorshard", from_stock, stock))
    for name, ours, ref in checks:
        assert sorted(ours["losses"]) == [3, 4, 5], (release, name, ours["losses"])
        for step, loss in ours["losses"].items():
            assert abs(loss - ref["losses"][step]) <= FP32["loss"], (release, name, step)
        for key, value in ref["params"].items():
            torch.testing.assert_close(
                ours["params"][key],
                value,
                rtol=0,
                atol=FP32["param"],
                msg=lambda m, name=name, key=key: f"deepspeed {release} {name} {key}: {m}",
            )
    record(release, check="equivalence and checkpoints", ok=True, references=refs, largest_loss_difference=worst)
