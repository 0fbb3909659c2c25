"""Peak device memory of ``probe_worker.py step`` at N ranks on emulated CUDA, ds_tensorshard then stock ZeRO-3
(issue 47's ``offload_param`` comparison; the peak is the largest sample, tests/helpers/emulated_accelerator.py):

    python -m tests.workers.peak_pair N OUT [WIDTH LAYERS OFFLOAD_PARAM]     (defaults 256 2 1)

prints each rank's peak, ours against stock's."""

from __future__ import annotations

import json
import os
import sys

from tests.helpers import WORKERS
from tests.helpers.emulated_accelerator import EMULATED
from tests.helpers.ranks import run_ranks


def main() -> None:
    n, out = int(sys.argv[1]), sys.argv[2]
    width, layers, offload = (sys.argv[3:6] + ["256", "2", "1"][len(sys.argv[3:6]) :])[:3]
    os.makedirs(out, exist_ok=True)
    env = {**EMULATED, "PROBE_STAGE": "3", "PROBE_WIDTH": width, "PROBE_LAYERS": layers}
    env["PROBE_OFFLOAD_PARAM"] = offload
    peaks = {}
    for mode in ("ts", "stock"):
        run_ranks([os.path.join(WORKERS, "probe_worker.py"), "step", f"{out}/{mode}", mode], n, env=env, timeout=1200)
        peaks[mode] = []
        for rank in range(n):
            with open(f"{out}/{mode}.rank{rank}.json") as f:
                peaks[mode].append(json.load(f)["peak_bytes"])
    for rank, (ours, stock) in enumerate(zip(peaks["ts"], peaks["stock"])):
        print(f"rank {rank}: peak ours {ours / 2**20:.1f} MiB, stock {stock / 2**20:.1f} MiB, {ours / stock:.3f}x")


if __name__ == "__main__":
    main()
