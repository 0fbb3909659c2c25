"""The round store's announcement (ds_tensorshard/transports/elastic_store.py) in one process: a previous round's
announcement is passed over, and a rank that gets no answer fails within the timeout, naming what it waited for."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
from torch.distributed import TCPStore

from ds_tensorshard.errors import ElasticStoreError
from ds_tensorshard.transports import elastic_store

TIMEOUT = datetime.timedelta(seconds=20)


def agent_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def closed_port() -> int:
    """A port nothing listens on (as a previous round's store, whose process has ended)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_previous_rounds_announcement_is_passed_over_for_this_rounds_store():
    agent = agent_store()
    agent.set(elastic_store.ANNOUNCE_KEY, f"{closed_port()} dead-round-token")
    served = {}

    def rank0_late() -> None:
        time.sleep(1.5)
        served["store"] = elastic_store.serve_round_store(agent_store_client(agent), "127.0.0.1", 2, TIMEOUT)

    thread = threading.Thread(target=rank0_late)
    thread.start()
    store = elastic_store.join_round_store(agent_store_client(agent), "127.0.0.1", 1, 2, TIMEOUT)
    thread.join()
    assert store.port == served["store"].port != agent.port
    store.set("written-by-rank-1", "yes")
    assert served["store"].get("written-by-rank-1") == b"yes"  # one store, this round's


def test_no_announcement_fails_within_the_timeout_naming_the_wait_and_torchruns_remedy():
    agent = agent_store()
    started = time.monotonic()
    with pytest.raises(ElasticStoreError) as err:
        elastic_store.join_round_store(agent_store_client(agent), "127.0.0.1", 1, 2, datetime.timedelta(seconds=3))
    assert time.monotonic() - started < 3 + elastic_store.PROBE_S + 2
    message = str(err.value)
    assert "rank 1 waited 3 s" in message and elastic_store.ANNOUNCE_KEY in message, message
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message, message


def agent_store_client(agent: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", agent.port, None, False, TIMEOUT)
