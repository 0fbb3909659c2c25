"""What the processes of a DeepSpeed-suite run record: one JSON line per engine, appended to the file named by
``DS_TENSORSHARD_SUITE_EVENTS``. The test process reads the lines a test added (:mod:`.results`).

Kinds: ``zero12`` (an engine of ZeRO stage 1 or 2 with an optimizer; ``detail`` its optimizer's class),
``engaged`` (that optimizer is ds_tensorshard's), ``zero3`` (an engine of ZeRO stage 3; ``detail`` its optimizer's
class, ``DeepSpeedZeRoOffload`` where it has none), ``engaged3`` (that optimizer is ds_tensorshard's stage 3),
``init3`` and ``owned3`` (a ``zero.Init`` with a stage-3 config, and one whose parameters ds_tensorshard converted:
:mod:`.forcing`), ``refused`` (``deepspeed.initialize`` raised a ``TensorShardConfigError``; ``detail`` its
message).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

EVENTS = "DS_TENSORSHARD_SUITE_EVENTS"  # the file the records go to
MODE = "DS_TENSORSHARD_SUITE_MODE"  # "stock" or "plugin"


def record(kind: str, detail: str = "") -> None:
    """Append one record (a single write of one line, so that ranks writing at once do not interleave)."""
    path = os.environ.get(EVENTS)
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), "kind": kind, "detail": detail[:2000]}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_from(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The records appended to ``path`` since byte ``offset``, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def instrument(mode: str) -> None:
    """Wrap ``DeepSpeedEngine.__init__`` to record what each engine was built with; in ``plugin`` mode, first
    register ds_tensorshard (``DS_TENSORSHARD=1`` in the environment turns it on for every stage-1/2 engine) and
    give every stage-3 config the ``tensorshard`` block (:mod:`.forcing`)."""
    if mode == "plugin":
        import ds_tensorshard  # noqa: F401  (registers the plugin)
    from deepspeed.runtime.engine import DeepSpeedEngine

    from tests.helpers.deepspeed_suite.forcing import install

    install(force=mode == "plugin")

    if getattr(DeepSpeedEngine.__init__, "_suite_recorded", False):
        return
    original = DeepSpeedEngine.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, *args, **kwargs)
        except Exception as err:
            if any(kind.__name__ == "TensorShardConfigError" for kind in type(err).__mro__):
                record("refused", str(err))
            raise
        _record_engine(self)

    __init__._suite_recorded = True  # type: ignore[attr-defined]
    DeepSpeedEngine.__init__ = __init__  # type: ignore[method-assign]


def _record_engine(engine: Any) -> None:
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and engine.zero_optimization_stage() == 3:
        record("zero3", type(optimizer).__name__)
        if type(optimizer).__name__ == "TensorShardStage3Optimizer":
            record("engaged3", "3")
    if optimizer is None or engine.zero_optimization_stage() not in (1, 2):
        return
    record("zero12", type(optimizer).__name__)
    if type(optimizer).__name__ == "TensorShardOptimizer":
        record("engaged", str(engine.zero_optimization_stage()))
