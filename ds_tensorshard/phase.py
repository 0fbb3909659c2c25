"""Where a :class:`~ds_tensorshard.TensorShardOptimizer` is in a step (what it may be asked for then)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the optimizer is in a step; only its own methods change it."""

    ACCUMULATING = "accumulating"  # backward passes run; reductions may be in flight
    REDUCED = "reduced"  # the boundary's backward was reduced: the step's gradients are on their owners
    PREPARED = "prepared"  # prepare_step() ran: the norm is known and the loss scale updated
    BROADCASTING = "broadcasting"  # step() ran with its broadcasts deferred; finish_broadcast() completes them
