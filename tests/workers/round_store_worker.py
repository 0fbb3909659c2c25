"""One worker of a torchrun round, without torchrun: the environment a c10d agent with its shared store gives
(``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT`` its store's), a gloo process group made through ``env://``,
one all-reduce, a look for the key an earlier round left in the group's store, then the key written and the group
destroyed.

python round_store_worker.py PLUGIN RANK0_DELAY_S
PLUGIN 1 imports ds_tensorshard first (its store per round), 0 not. Rank 0 waits RANK0_DELAY_S before joining, as
a slow rank 0 of a restarted round. Prints ``ROUND rank=R sum=S store_port=P stale=B`` (the port of the store the
group used; whether an earlier round's key was in it).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

PROBE_KEY = "round_store_worker/written"


def main() -> None:
    plugin, delay = sys.argv[1] == "1", float(sys.argv[2])
    if plugin:
        import ds_tensorshard  # noqa: F401  (registers the plugin)
    rank = int(os.environ["RANK"])
    if rank == 0:
        time.sleep(delay)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "20"))))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    default = dist.distributed_c10d._get_default_store()
    stale = default.check([PROBE_KEY])
    dist.barrier()
    if rank == 0:
        default.set(PROBE_KEY, "written")
    print(f"ROUND rank={rank} sum={total.item():g} store_port={store.port} stale={stale}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
