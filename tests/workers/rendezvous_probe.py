"""One worker of a torchrun restart probe: round 0 forms a gloo process group and exits 1; in round 1 rank 0
joins only 3 s after rank 1 has (a file ``rank1-joining`` in the working folder), so rank 1 reads rank 0's
address from the store first: the restarted rank's, or the dead predecessor's where the store is the same.

Prints ``PROBE restart=R rank=N master=ADDR:PORT`` before and ``connected`` after forming its process group; one
that cannot connect fails after 20 s (gloo retries a refused connection until the process group's timeout)."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    print(f"PROBE restart={restart} rank={rank} master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    if restart == 1 and rank == 1:
        open("rank1-joining", "w").close()
    if restart == 1 and rank == 0:
        deadline = time.monotonic() + 120
        while not os.path.exists("rank1-joining") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    dist.barrier()
    print(f"PROBE restart={restart} rank={rank} connected", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if restart == 0 else 0)


if __name__ == "__main__":
    main()
