"""Stage 3 with owned parameters gathers and releases exactly as stock ZeRO-3 does: the same collectives, in the same
order, on every rank (tests/workers/stage3_trace_worker.py records DeepSpeed's coordinator at 2 ranks).

Each property below is also asserted on its own, so that a change breaking it fails here by name: the prefetch
(later modules' parameters fetched ahead, in the recorded order), the release after use, the second gather for a
checkpointed block's recompute inside backward, and the tied embedding gathered again at its second use.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import WORKERS
from tests.helpers.ranks import run_ranks

CASES = [f"{mode}:{how}:{prefetch}" for mode in ("stock", "ts") for how, prefetch in
         (("deepspeed", "off"), ("non_reentrant", "off"), ("none", "half"))]  # fmt: skip
BLOCK = [f"blocks.0.{name}" for name in ("ln1", "qkv", "proj", "ln2", "fc", "out")]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    run_ranks([os.path.join(WORKERS, "stage3_trace_worker.py"), str(out), *CASES], 2)
    return lambda case, rank: torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt")


def last_micro_step(traces, case: str) -> list:
    """The events of the last micro-step (the trace recorded and complete since the first step)."""
    return traces(f"ts:{case}", 0)["micro_steps"][-1]


@pytest.mark.parametrize("case", ["deepspeed:off", "non_reentrant:off", "none:half"])
def test_gathers_and_releases_are_stock_zero3s_on_every_rank(traces, case):
    stock, ours = traces(f"stock:{case}", 0), traces(f"ts:{case}", 0)
    assert ours["micro_steps"] == stock["micro_steps"]
    assert ours["losses"] == stock["losses"]
    assert traces(f"ts:{case}", 1)["micro_steps"] == ours["micro_steps"]  # the same collectives on both ranks


def test_prefetch_fetches_later_modules_ahead(traces):
    events = last_micro_step(traces, "none:half")
    forward = [names for kind, *rest in events if kind == "gather" and rest[0] for names in [rest[1]]]
    modules = {name.rsplit(".", 1)[0] for names in forward for name in names}
    assert any(len({n.rsplit(".", 1)[0] for n in names}) > 1 for names in forward), forward  # ahead of use
    assert len(forward) < len(modules)  # fewer collectives than modules
    order = [name.rsplit(".", 1)[0] for names in forward for name in names if name.startswith("blocks.")]
    assert order.index("blocks.0.qkv") < order.index("blocks.1.qkv"), order  # in the recorded (execution) order


def test_each_module_is_released_after_its_use(traces):
    events = last_micro_step(traces, "deepspeed:off")
    for block in BLOCK:
        gather = events.index(("gather", True, [f"{block}.bias", f"{block}.weight"]))
        assert events[gather + 1 : gather + 3] == [("release", f"{block}.weight"), ("release", f"{block}.bias")]
    run = traces("ts:deepspeed:off", 0)
    assert run["peak"] < run["total"] / 4, (run["peak"], run["total"])


@pytest.mark.parametrize("how", ["deepspeed", "non_reentrant"])
def test_a_checkpointed_block_is_gathered_again_for_its_recompute(traces, how):
    events = last_micro_step(traces, f"{how}:off")
    backward = events[events.index(("gather", False, ["frozen_scale", "unused"])) :]
    for block in BLOCK[:-1]:  # a block's last module is kept between its recompute and its backward
        names = [f"{block}.bias", f"{block}.weight"]
        assert ("gather", True, names) in backward and ("gather", False, names) in backward, block


def test_the_tied_embedding_is_gathered_at_each_use(traces):
    events = last_micro_step(traces, "deepspeed:off")
    tied = [rest[0] for kind, *rest in events if kind == "gather" and rest[1] == ["wte.weight"]]
    assert tied == [True, True, False, False]  # embedding and head, forward and backward
