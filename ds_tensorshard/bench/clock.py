"""Wall time per phase of a benchmark step, added up by wrapping the functions that do each phase."""

from __future__ import annotations

import functools
import time
from collections import defaultdict


class Clock:
    """Adds up wall time per phase, for wrapped functions and explicit blocks."""

    def __init__(self) -> None:
        self.spent: defaultdict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time every call of ``owner.name`` as ``phase``."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    @classmethod
    def of_gathers(cls) -> Clock:
        """A clock timing the parameters' return after the update as "gather": ours (per bucket, or the flat
        parameters' one collective) and stock ZeRO-1/2's all-gather."""
        from deepspeed.runtime.zero import stage_1_and_2

        from ds_tensorshard.datapath import broadcast, flat_parameters

        clock = cls()
        clock.wrap(broadcast.Broadcast, "finish", "gather")
        clock.wrap(flat_parameters.FlatParameters, "start_gather", "gather")
        clock.wrap(flat_parameters.FlatGather, "finish", "gather")
        clock.wrap(stage_1_and_2, "all_gather_dp_groups", "gather")
        return clock
