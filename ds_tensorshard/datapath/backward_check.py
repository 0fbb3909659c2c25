"""Who runs a backward: ``engine.backward(loss)``, or a direct ``loss.backward()`` (PyTorch style), which only some
DeepSpeed releases end as stock does. On the others a direct backward is refused at its first gradient, before
anything is reduced."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_tensorshard.errors import TensorShardUsageError


def direct_backward_refusal(release: tuple[int, ...]) -> str | None:
    """Why a direct ``loss.backward()`` (instead of ``engine.backward(loss)``) cannot run as stock on DeepSpeed
    ``release``, or None: from 0.18.5 the engine itself runs the end of such a backward (its reduction) from an
    autograd callback, for any ZeRO optimizer; 0.18.3 and 0.18.4 leave it to stock ZeRO's own gradient hooks,
    which ds_tensorshard replaces; earlier releases have no PyTorch-style backward at all."""
    if release >= (0, 18, 5):
        return None
    if release >= (0, 18, 3):
        return "its engine leaves the end of a direct backward (the reduction) to stock ZeRO's own gradient hooks"
    return "it has no PyTorch-style backward (DeepSpeed 0.18.3 added it): only engine.backward(loss) reduces"


class BackwardCheck:
    """Called as each gradient arrives (``check()``). ``refusal``: the release's reason, None where every backward
    is followed; ``engine_running()``: the engine's flag that it runs a backward (None on engines without it, which
    run ``engine.backward`` through the optimizer's ``backward``: then ``in_optimizer_backward`` tells)."""

    def __init__(self, release: tuple[int, ...], refuse: bool, engine_running: Callable[[], bool | None]) -> None:
        reason = direct_backward_refusal(release) if refuse else None
        self.refusal = reason and f"deepspeed {'.'.join(map(str, release))}: {reason}"
        self.engine_running = engine_running
        self.in_optimizer_backward = False

    @classmethod
    def of(cls, engine: Any, release: tuple[int, ...]) -> BackwardCheck:
        """An engine's check on DeepSpeed ``release``: a direct ``loss.backward()`` is followed where the engine
        runs its end (from 0.18.5), else refused when it starts; a PipelineEngine runs every backward itself."""
        running = lambda: getattr(engine, "_running_engine_backward", None)  # noqa: E731
        return cls(release, not isinstance(engine, PipelineEngine), running)

    @contextlib.contextmanager
    def through_optimizer(self) -> Iterator[None]:
        """The optimizer's ``backward`` runs (an engine before 0.18.3 runs ``engine.backward`` through it)."""
        self.in_optimizer_backward = True
        try:
            yield
        finally:
            self.in_optimizer_backward = False

    def check(self) -> None:
        if self.refusal is None:
            return
        running = self.engine_running()
        if running is None:
            running = self.in_optimizer_backward
        if not running:
            raise TensorShardUsageError(
                "ds_tensorshard: loss.backward() was called directly, not through engine.backward(loss), on "
                f"{self.refusal}; so the gradients would not be reduced as stock reduces them. "
                "Call engine.backward(loss), or use deepspeed >= 0.18.5"
            )
