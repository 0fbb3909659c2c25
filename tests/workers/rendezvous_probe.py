"""One worker of a torchrun restart probe: does a restarted round see the store of the round before?

Round 0 forms a gloo process group, rank 0 writes the key ``probe/round0`` into the workers' store
(``MASTER_ADDR:MASTER_PORT``), and both exit 1, so torchrun restarts them. In round 1 rank 1 looks for that key
in its store and prints ``PROBE restart=1 rank=1 stale_keys=True|False``: True where the store is the one of
round 0 (as are the dead ranks' gloo addresses in it). Where the workers' rank 0 serves the store itself
(``TORCHELASTIC_USE_AGENT_STORE`` False), round 1's rank 0 starts it. Every rank prints
``PROBE restart=R rank=N master=ADDR:PORT`` first.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)


def main() -> None:
    restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    print(f"PROBE restart={restart} rank={rank} master={host}:{port}", flush=True)
    if restart == 0:
        dist.init_process_group("gloo", timeout=TIMEOUT)
        if rank == 0:
            dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT).set("probe/round0", "written")
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(1)
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(host, port, is_master=serves, timeout=TIMEOUT, wait_for_workers=False)
    if rank == 1:
        print(f"PROBE restart=1 rank=1 stale_keys={store.check(['probe/round0'])}", flush=True)
        store.set("probe/round1-done", "1")
    else:
        store.wait(["probe/round1-done"])  # a serving rank 0 keeps the store up until rank 1 has looked


if __name__ == "__main__":
    main()
