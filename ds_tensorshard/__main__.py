"""``python -m ds_tensorshard SCRIPT [ARGS...]``: run an unmodified training script with the plugin registered.

Also works as ``deepspeed --module ds_tensorshard SCRIPT ...`` and ``mpiexec -n N python -m
ds_tensorshard SCRIPT ...``. The deepspeed launcher puts ``--local_rank=N`` before SCRIPT; it is
handed on to the script as its first argument, as a direct launch would have done.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m ds_tensorshard [--local_rank=N] SCRIPT [ARGS...]"


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """Return the script path and the arguments it should see (launcher flags moved after it)."""
    launcher_flags: list[str] = []
    rest = list(argv)
    while rest and rest[0].startswith("--local_rank"):
        flag = rest.pop(0)
        if flag == "--local_rank" and rest:
            flag = f"--local_rank={rest.pop(0)}"
        launcher_flags.append(flag)
    if not rest or rest[0].startswith("-"):
        raise SystemExit(USAGE)
    return rest[0], [*launcher_flags, *rest[1:]]


def main() -> None:
    script, args = split_argv(sys.argv[1:])
    import ds_tensorshard  # noqa: F401  (registers the plugin before the script's deepspeed.initialize)

    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
