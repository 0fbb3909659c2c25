"""A store of its own for every torchrun round, with torchrun's defaults.

By default torchrun's c10d rendezvous has its workers share one TCPStore, served by the rank-0 agent and
kept across restarts (``TORCHELASTIC_USE_AGENT_STORE=True``). A restarted round's process group writes the same
keys as the dead round's did, so a rank could read a dead rank's gloo address and retry it until the
process group's timeout (``Gloo connectFullMesh failed ... Connection refused``), or read a dead round's
counters and wait. Where the plugin is installed, ``init_process_group``'s ``env://`` rendezvous under such an
agent gives each round a new store instead: the workers' rank 0 serves one on a free port of its host (the
host ``MASTER_ADDR`` names), and announces the port with a random token in the agent's store; every other rank
takes the announced port once the store there answers with that token. A previous round's announcement names
the store of a process that has ended (nothing answers) or of another round (another token), and is passed
over. A rank that sees no answer within the process group's timeout raises :class:`ElasticStoreError`, naming
what it waited for and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's own way to a new store per round).
Elsewhere ``env://`` is torch's own.
"""

from __future__ import annotations

import datetime
import importlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ds_tensorshard.errors import ElasticStoreError

ANNOUNCE_KEY = "ds_tensorshard/round_store"  # in the agent's store: "PORT TOKEN" of this round's store
TOKEN_KEY = "ds_tensorshard/round_token"  # in the round's store: its TOKEN
PROBE_S = 2.0  # how long one look at an announced store may take
_MARK = "_ds_tensorshard_original"
_used = False  # whether this process's default process group got a round store


def shared_agent_store(env: dict[str, str] | os._Environ) -> bool:
    """Whether torchrun gives these workers the agent's store, kept across rounds (its default)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def serve_round_store(agent: Any, host: str, world_size: int, timeout: datetime.timedelta) -> Any:
    """Rank 0: a new store on a free port, announced in the agent's store."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, world_size, True, timeout, wait_for_workers=False, multi_tenant=True)
    token = uuid.uuid4().hex
    store.set(TOKEN_KEY, token)
    agent.set(ANNOUNCE_KEY, f"{store.port} {token}")
    return store


def join_round_store(agent: Any, host: str, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """Ranks above 0: the store rank 0 announced for this round, once it answers with the announced token."""
    from torch.distributed import TCPStore

    deadline = time.monotonic() + timeout.total_seconds()
    seen = "nothing"
    agent.set_timeout(datetime.timedelta(seconds=PROBE_S))
    while time.monotonic() < deadline:
        try:
            port, token = agent.get(ANNOUNCE_KEY).decode().split()
            seen = f"port {port}"
            store = TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=PROBE_S))
            if store.get(TOKEN_KEY).decode() == token:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, ValueError):  # not announced yet, or a previous round's store: nothing answers
            pass
        time.sleep(0.2)
    raise ElasticStoreError(
        f"ds_tensorshard: rank {rank} waited {timeout.total_seconds():g} s (the process group's timeout) for the "
        f"store of this torchrun round, which rank 0 serves on {host} and announces under '{ANNOUNCE_KEY}' in the "
        f"agent's store (last seen: {seen}); rank 0 has not started or cannot be reached. Start torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun's own new store each round"
    )


def _round_handler(original: Any) -> Any:
    def env_rendezvous(url: str, timeout: datetime.timedelta | None = None, **kwargs: Any) -> Iterator[tuple]:
        from torch.distributed.constants import default_pg_timeout

        timeout = default_pg_timeout if timeout is None else timeout
        rounds = original(url, timeout=timeout, **kwargs)
        agent, rank, world_size = next(rounds)
        if not shared_agent_store(os.environ):
            yield agent, rank, world_size
            return
        global _used
        host = os.environ["MASTER_ADDR"]
        _used = True
        if rank == 0:
            store = serve_round_store(agent, host, world_size, timeout)
        else:
            store = join_round_store(agent, host, rank, world_size, timeout)
        yield store, rank, world_size
        raise ElasticStoreError("Unable to perform re-rendezvous using env:// method")  # as torch's own handler

    setattr(env_rendezvous, _MARK, original)
    return env_rendezvous


def _handlers() -> dict:
    """torch.distributed's rendezvous handlers by scheme (``torch.distributed.rendezvous`` names a function too)."""
    return importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers


def install() -> None:
    """Route ``env://`` rendezvous through :func:`_round_handler` (idempotent)."""
    handlers = _handlers()
    if "env" in handlers and getattr(handlers["env"], _MARK, None) is None:
        handlers["env"] = _round_handler(handlers["env"])


def installed() -> bool:
    return getattr(_handlers().get("env"), _MARK, None) is not None


def round_store_in_use() -> bool:
    """Whether this process's process group was made with a round store of its own (torchrun's shared store)."""
    return _used
