"""Deadlines for the plugin's own collectives, and the diagnosis when one passes.

Every wait of the data path has ``tensorshard.timeout_s`` seconds. When it passes, each rank
that timed out writes where it waits into torch.distributed's key-value store, waits a moment for
the others, and reads theirs back: ranks that wrote nothing have not arrived (stopped, stuck, or
dead), ranks that wrote another place are on another step or bucket. The error names the step,
the bucket and its first tensor, the transport, and those ranks.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ds_tensorshard.errors import CollectiveTimeout

if TYPE_CHECKING:
    from ds_tensorshard.transports.protocol import Transport

STORE_PREFIX = "ds_tensorshard/timeout/"
GRACE_S = 3.0  # how long a timed-out rank waits for the others' reports


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def missing_ranks(rank: int, world_ranks: list[int], where: str) -> str:
    """Report this rank's place through the store and describe the ranks that are not there too."""
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=GRACE_S))
        store.set(f"{STORE_PREFIX}{rank}", where)
        time.sleep(GRACE_S)
        absent, elsewhere = [], []
        for other in world_ranks:
            key = f"{STORE_PREFIX}{other}"
            if not store.check([key]):
                absent.append(other)
                continue
            theirs = store.get(key).decode()
            if theirs != where:
                elsewhere.append(f"rank {other} waits at {theirs}")
    except Exception as err:  # noqa: BLE001 - the store itself may be out of reach (its host stopped)
        return f"which ranks are missing could not be told ({type(err).__name__}: {err})"
    parts = [f"ranks that have not arrived: {absent}" if absent else "every rank has arrived"]
    return "; ".join(parts + elsewhere)


def wait_with_deadline(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` (which drives progress) until it is true or ``timeout_s`` passes; whether it is done."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause + 1e-5, 1e-3)
    return True


LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, a peer's process gone


def wait_or_fail(wait: Callable[[], Any], comm: Transport, where: Callable[[], str]) -> Any:
    """``wait()``; past the deadline, or where a peer's process is gone, the diagnosis and the transport's
    ``fail`` (raise or abort)."""
    try:
        return wait()
    except CollectiveTimeout as err:
        place = where()
        comm.fail(
            f"ds_tensorshard: {place}: {err} did not complete within tensorshard.timeout_s="
            f"{comm.timeout_s:g} s on the {comm.name} transport; "
            f"{missing_ranks(comm.global_ranks[comm.rank], comm.global_ranks, place)}"
        )
    except RuntimeError as err:
        if not any(words in str(err) for words in LOST_PEER):
            raise
        place = where()
        comm.fail(
            f"ds_tensorshard: {place}: a rank was lost on the {comm.name} transport ({str(err)[:300]}); "
            f"{missing_ranks(comm.global_ranks[comm.rank], comm.global_ranks, place)}"
        )
