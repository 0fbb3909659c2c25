"""A store of its own for each torchrun round (ds_tensorshard/transports/elastic_store.py), on one host without
torchrun: the test serves the agent's store, as torchrun's c10d rank-0 agent does with its defaults
(``TORCHELASTIC_USE_AGENT_STORE=True``), and starts two rounds of two workers in it (tests/workers/
round_store_worker.py), the second with rank 0 joining 4 s late, as a restarted round whose rank 0 is slow. With
the plugin both rounds form their gloo group, each in a store of its own, and the second finds nothing of the
first; without it both use the agent's store, where the second finds the first round's keys (torch's own gloo
addresses among them: a rank that reads its peer's before the peer has replaced it connects to a dead process,
as in docs/cluster.md, Elastic training)."""

from __future__ import annotations

import os
import re
import time

import pytest
from torch.distributed import TCPStore

from tests.helpers import WORKERS
from tests.helpers.ranks import start_ranks

WORKER = os.path.join(WORKERS, "round_store_worker.py")
# bounds a failure only: rank 0 starts 4 s late in the second round, and with 8 s a loaded 2-core machine (load
# about 8, a default-suite run beside other tests) once saw rank 1 give up before rank 0 had announced its store
PG_TIMEOUT_S = 30


def run_round(agent: TCPStore, plugin: bool, rank0_delay_s: float, restart: int) -> tuple[list[int | None], list[str]]:
    env = {
        "MASTER_PORT": str(agent.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "PG_TIMEOUT_S": str(PG_TIMEOUT_S),
    }
    ranks = start_ranks([WORKER, "1" if plugin else "0", str(rank0_delay_s)], 2, env)
    deadline = time.monotonic() + 180
    try:
        codes = [rank.wait(deadline) for rank in ranks]
        outputs = [rank.text() for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    return codes, outputs


def rounds(outputs: list[str]) -> set[tuple[int, str]]:
    """The (store port, stale) pairs the ranks printed: one pair where the ranks agree."""
    found = [re.search(r"ROUND rank=\d sum=3 store_port=(\d+) stale=(True|False)", out) for out in outputs]
    assert all(found), outputs
    return {(int(m.group(1)), m.group(2)) for m in found if m}


@pytest.mark.extended  # CI time (19 s): the store's rounds stay in tests/unit/test_elastic_store.py
def test_each_round_gets_a_store_of_its_own_where_the_agent_shares_one():
    agent = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    first = run_round(agent, True, 0.0, 0)
    assert first[0] == [0, 0], first[1]
    second = run_round(agent, True, 4.0, 1)  # rank 1 first finds the first round's announcement: a dead store
    assert second[0] == [0, 0], second[1]
    ((port0, stale0),), ((port1, stale1),) = rounds(first[1]), rounds(second[1])
    assert len({agent.port, port0, port1}) == 3 and (stale0, stale1) == ("False", "False")


@pytest.mark.extended
def test_without_the_plugin_the_restarted_round_finds_the_previous_rounds_keys():
    agent = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    first = run_round(agent, False, 0.0, 0)
    assert first[0] == [0, 0] and rounds(first[1]) == {(agent.port, "False")}, first[1]
    codes, outputs = run_round(agent, False, 0.0, 1)
    if codes == [0, 0]:  # the group formed: in the same store as the first round, whose keys are there
        assert rounds(outputs) == {(agent.port, "True")}, outputs
    else:  # a rank read the first round's gloo address (as the restarts did)
        assert any("Connection refused" in out for out in outputs), outputs
