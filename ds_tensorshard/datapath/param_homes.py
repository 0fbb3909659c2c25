"""Where each trained parameter's ``.data`` lives, and pointing it back there before an update.

Stock ZeRO-1/2 points every parameter back at its flat group after each step, so a parameter whose ``.data`` a
module replaced after ``deepspeed.initialize`` (Switch Transformers' router casts itself to fp32 in every
forward) is the flat group's view again, and what was put in its place is dropped: the masters hold the values.
:class:`ParameterHomes` does the same before the owners write their updates, in every layout (flat parameters'
homes are their views of the storage), so those updates reach the tensors every rank trains with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class ParameterHomes:
    """The tensor each parameter's ``.data`` was at initialization, or where this plugin last moved it."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.follow()

    def follow(self) -> None:
        """Record where the parameters are now (after initialize lays them out, or after ``offload_states``)."""
        self.homes = {param: param.data for param in self.params}

    def restore(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Every parameter (of ``params``, else all) whose ``.data`` was replaced is its home again (that tensor's
        values, its dtype)."""
        for param in self.params if params is None else params:
            home = self.homes[param]
            if param.data_ptr() != home.data_ptr() or param.dtype != home.dtype:
                param.data = home
