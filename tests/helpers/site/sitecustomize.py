"""Test-only: every Python process the tests start imports this (tests/conftest.py puts this folder first on
PYTHONPATH). DeepSpeed's JIT op loader asks py-cpuinfo for the CPU's architecture and SIMD width twice per
process, and py-cpuinfo answers each time by starting another interpreter that probes the CPU: 2.2 s of every
rank's start on this machine. The answer is a property of the machine, so the first process stores it in
``DS_TENSORSHARD_TEST_CPUINFO`` (a JSON file of the test session) and the others read it. Nothing else is
changed: DeepSpeed still loads (and, if needed, builds) its ops itself, with the same flags.
"""

import json
import os


def _share_cpu_info(path: str) -> None:
    import cpuinfo

    probe = cpuinfo.get_cpu_info

    def get_cpu_info() -> dict:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            info = probe()
            partial = f"{path}.{os.getpid()}"
            with open(partial, "w") as f:
                json.dump(info, f)
            os.replace(partial, path)
            return info

    cpuinfo.get_cpu_info = get_cpu_info


if os.environ.get("DS_TENSORSHARD_TEST_CPUINFO"):
    try:
        _share_cpu_info(os.environ["DS_TENSORSHARD_TEST_CPUINFO"])
    except ImportError:  # no py-cpuinfo: DeepSpeed falls back to lscpu by itself
        pass
