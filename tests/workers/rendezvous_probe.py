"""One worker of a torchrun restart probe: round 0 forms a gloo process group and exits 1; in round 1 rank 0
starts 5 s late, so rank 1 reads rank 0's address from the store first (the restart's or the dead predecessor's).

Prints ``PROBE restart=R rank=N connected`` once its process group is up; a process group that cannot connect
fails after 20 s (gloo retries a refused connection until the process group's timeout)."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if restart == 1 and rank == 0:
        time.sleep(5)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    dist.barrier()
    print(f"PROBE restart={restart} rank={rank} connected", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if restart == 0 else 0)


if __name__ == "__main__":
    main()
