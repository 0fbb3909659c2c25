"""``engine.offload_states()`` / ``reload_states()`` at stage 3: as at stages 1/2
(:class:`~ds_tensorshard.datapath.offload.StateOffload`), where the model's tensors (``lp_params``) are what each
rank keeps of every parameter, its ``ds_tensor`` (the owner's tensor or block; elsewhere an empty placeholder).

As stock's stage 3, offloading first releases every gathered parameter (``empty_partition_cache``: the persistent
ones too), and reloading gathers the persistent ones again, as after a step.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

import torch
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.offload import StateOffload
from ds_tensorshard.datapath.update import OwnedShard
from ds_tensorshard.parameters.zero_param import ZeroParam


class Stage3StateOffload(StateOffload):
    """The states of a stage-3 optimizer off the device and back; ``model``: every parameter of the module;
    ``release``: empties the partition cache; ``persistent``: gathered again after a reload."""

    def __init__(
        self,
        shard: OwnedShard,
        params: Sequence[torch.nn.Parameter],
        buckets: Callable[[], Iterable[Bucket]],
        model: Iterable[ZeroParam],
        release: Callable[[], None],
        persistent: Sequence[ZeroParam],
    ) -> None:
        super().__init__(shard, params, buckets)
        self.model, self.release, self.persistent = list(model), release, list(persistent)

    def offload(
        self, include: Container[OffloadStateTypeEnum] | None, device: str, pin_memory: bool, non_blocking: bool
    ) -> None:
        chosen = self._chosen(include)  # a refusal touches nothing
        self.release()
        self._move_out(chosen, device, pin_memory, non_blocking)

    def reload(self, device: torch.device, non_blocking: bool) -> None:
        super().reload(device, non_blocking)
        if self.persistent:
            self.persistent[0].all_gather(self.persistent)

    def _move_model(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for param in self.model:
            param.ds_tensor = moved(param.ds_tensor)
