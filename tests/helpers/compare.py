"""Shared assertions of the multi-process tests: a run matches its reference within the dtype's tolerance.

Measured: at 2 ranks every dtype and stage is bit-identical to stock; fp32 at 3+ ranks within about
1e-6 on parameters. In bf16/fp16 the sum over ranks rounds in another order than stock's
collective (3+ ranks), and Adam turns a rounding-level change of a near-zero gradient into up to one
learning-rate step (peak lr 1e-2) on that element; so low precision is held to: losses and grad
norms within a few ulps, every parameter within one peak-lr step, and the mean parameter difference tiny.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

TOLERANCE = {  # loss atol, norm rtol, param rtol, param atol, param mean |diff|
    # fp32: measured within 4.8e-7 (losses) and 9.2e-7 (parameters) at 3 ranks; about 10x that
    "fp32": dict(loss=1e-5, norm=1e-5, rtol=1e-5, atol=5e-6, mean=1e-6),
    # bf16 (3 ranks, measured): losses 2.5e-4, parameters 3.9e-3; held to 4x and to one peak-lr step (1e-2)
    "bf16": dict(loss=1e-3, norm=1e-3, rtol=0.0, atol=1e-2, mean=1e-3),
    # fp16 (3 ranks, measured): losses 2.6e-5, parameters 4.9e-4; held to about 4x
    "fp16": dict(loss=1e-4, norm=1e-4, rtol=0.0, atol=2e-3, mean=2e-4),
}
# A run resumed (or trained) at another world size sums the same gradients in another order: measured within
# 3.2e-7 (losses) and 6.5e-6 (parameters) in fp32 (tables in docs/checkpoints.md, frameworks.md, parallelism.md)
ACROSS_WORLDS = {"fp32": dict(loss=1e-5, param=1e-5), "bf16": dict(loss=1e-3, param=1e-2)}


def assert_run_matches(
    ours: dict, reference: dict, dtype: str, where: str, loose: dict | None = None, loss_atol: float | None = None
) -> None:
    """Same losses, grad norms, skipped steps and final parameters (an equivalence worker's results).

    ``loose``: parameter name -> absolute tolerance, for a tensor whose true gradient is zero (an attention's
    key bias), where Adam turns the rounding noise of another summation order into lr-sized steps. ``loss_atol``:
    the losses' tolerance instead of the dtype's."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        torch.tensor(ours["losses"]),
        torch.tensor(reference["losses"]),
        rtol=0,
        atol=tol["loss"] if loss_atol is None else loss_atol,
        msg=lambda m: f"{where} losses: {m}",
    )
    if "norms" in reference:
        torch.testing.assert_close(
            torch.tensor(ours["norms"]),
            torch.tensor(reference["norms"]),
            rtol=tol["norm"],
            atol=0,
            equal_nan=True,
            msg=lambda m: f"{where} grad norms: {m}",
        )
        assert ours["skipped_steps"] == reference["skipped_steps"], where
    assert ours["params"].keys() == reference["params"].keys(), where
    for name, value in reference["params"].items():
        a = ours["params"][name]
        if loose and name in loose:
            torch.testing.assert_close(
                a, value, rtol=0, atol=loose[name], msg=lambda m, name=name: f"{where} {name}: {m}"
            )
            continue
        torch.testing.assert_close(
            a, value, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m, name=name: f"{where} {name}: {m}"
        )
        if value.numel():
            assert (a - value).abs().mean() <= tol["mean"], f"{where} {name}: mean |diff| {(a - value).abs().mean()}"


def within_ulps(a: float, b: float, ulps: int) -> bool:
    """Equal, both nan (an overflow step), or within ``ulps`` fp32 units in the last place (2**-23 relative)."""
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= ulps * 2**-23 * abs(b)


def assert_cases_match(load: Callable[[str, int], dict], world: int, pairs: list[tuple[str, str]]) -> None:
    """Every (case, reference case) pair matches on every rank."""
    for case, reference in pairs:
        for rank in range(world):
            assert_run_matches(
                load(case, rank), load(reference, rank), case.split(":")[0], f"{case} vs {reference} rank {rank}"
            )


def assert_full_tensors_match(ours: dict, stock: dict, exact: bool, where: str) -> None:
    """Every tensor ``tests/workers/full_tensor_worker.py`` read through ``deepspeed.utils``' getters equals stock's:
    bit for bit where ``exact`` (2 ranks: each element is summed in stock's order), else within the fp32
    tolerance relative to the tensor's largest element (3 ranks: another summation order, carried on by Adam,
    measured within 4.4e-7 of it; the moments are tiny, so an absolute tolerance would say nothing)."""
    assert ours["seen"].keys() == stock["seen"].keys(), where
    tol = TOLERANCE["fp32"]
    for key, value in stock["seen"].items():
        a = ours["seen"][key]
        assert a.dtype == value.dtype == torch.float32 and a.shape == value.shape, f"{where}: {key}"
        if exact:
            assert torch.equal(a, value), f"{where}: {key}: max |diff| {(a - value).abs().max()}"
            continue
        scale = max(value.abs().max().item(), 1e-30)
        torch.testing.assert_close(
            a / scale, value / scale, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m, key=key: f"{where}: {key}: {m}"
        )
