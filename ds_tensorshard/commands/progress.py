"""Progress bars for long commands: shown on a terminal, silent in logs.

A bar is drawn only when stdout is a terminal (``DS_TENSORSHARD_PROGRESS=1`` forces it on, ``=0`` off);
otherwise :func:`bar` returns an object with the same methods that prints nothing, so a log or a pipe
gets the command's results and no carriage-return noise.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

ENV = "DS_TENSORSHARD_PROGRESS"


def interactive() -> bool:
    """Whether progress should be shown: stdout is a terminal, unless ``DS_TENSORSHARD_PROGRESS`` says otherwise."""
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stdout.isatty()


class _Silent:
    """What :func:`bar` returns off a terminal: the bar's methods, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def bar(total: int | None, desc: str, unit: str = "it", show: bool | None = None) -> Any:
    """A tqdm bar on a terminal (on stderr when that is a terminal too, else on stdout), else a silent one."""
    if not (interactive() if show is None else show):
        return _Silent()
    from tqdm import tqdm

    stream = sys.stderr if sys.stderr.isatty() else sys.stdout
    return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True)


def terminal_callback(desc: str, unit: str = "tensor") -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing a bar on a terminal (closed when done reaches total),
    doing nothing elsewhere: for functions that report their own progress, such as the converters."""
    state: dict[str, Any] = {"done": 0}

    def report(done: int, total: int) -> None:
        if "bar" not in state:
            state["bar"] = bar(total, desc, unit)
        state["bar"].update(done - state["done"])
        state["done"] = done
        if done >= total:
            state["bar"].close()

    return report
