"""Early update (ZeRO-Offload): each owned tensor is updated on the host as soon as the last reduced piece of its
step's gradient arrives, while backward and the other buckets' reductions go on (on the host worker, not the
autograd thread); ``step()`` then updates only the tensors not yet updated, and broadcasts.

Only where the step's outcome cannot depend on gradients that have not arrived yet, so the result is stock's
bit for bit: no clipping (``gradient_clipping`` 0) and no step that an inf/nan norm could skip, i.e. bf16 with
``bf16.check_grad_overflow`` false. Stock skips a step on an inf/nan norm in fp32 and fp16 (and with bf16's
default check), and that norm is known only after the last reduction; ``compute_grad_norm`` false, which would
drop the norm, is refused with offload, as stock refuses it. The inner optimizer keeps a
step count per tensor (DeepSpeed's CPU optimizers, torch's), so updating tensors in several calls is the same
update; the global norm is still computed at ``step()`` from the same gradients, for
``engine.get_global_grad_norm()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from ds_tensorshard.datapath.buckets import Bucket
from ds_tensorshard.datapath.norm import NormRules
from ds_tensorshard.datapath.param_homes import ParameterHomes
from ds_tensorshard.datapath.update import OwnedShard


def updates_early(rules: NormRules, offloaded: bool) -> bool:
    """Whether a step's updates may start before its last reduction: offloaded, no clipping, no skippable step."""
    return offloaded and rules.clip == 0.0 and not rules.checks_overflow


class EarlyUpdate:
    """Counts the reduced pieces of each owned tensor that reach this ``rank`` in a boundary backward and
    updates a tensor once all of its pieces are there. ``progress()`` is ``(reductions finished, buckets)``:
    where the first update was given to the host worker is kept in ``first_update_at``."""

    def __init__(
        self,
        shard: OwnedShard,
        rank: int,
        at_boundary: Callable[[], bool],
        progress: Callable[[], tuple[int, int]],
        homes: ParameterHomes,
    ) -> None:
        self.shard, self.rank, self.at_boundary, self.progress = shard, rank, at_boundary, progress
        self.homes = homes
        self.arrived: Counter[torch.nn.Parameter] = Counter()
        self.expected: Counter[torch.nn.Parameter] = Counter()
        self.first_update_at: tuple[int, int] | None = None

    def expect(self, buckets: Sequence[Bucket]) -> None:
        """The buckets a backward reduces in (they are laid out again once backward's order is known)."""
        mine = (bucket.segment_of(self.rank) for bucket in buckets)
        self.expected = Counter(piece.param for segment in mine if segment is not None for piece in segment.pieces)

    @torch.no_grad()
    def deliver(self, bucket: Bucket, segment: torch.Tensor) -> None:
        """A reduced segment arrived: accumulate it and, at the boundary, update the tensors it completes, on the
        host worker (:mod:`~ds_tensorshard.datapath.host_worker`) after its add there, off the autograd thread."""
        self.shard.accept(bucket, segment, self.rank)
        if not self.at_boundary():
            return
        owned = bucket.segment_of(self.rank)
        assert owned is not None, "a segment is delivered only to its owner"
        complete = []
        for piece in owned.pieces:
            self.arrived[piece.param] += 1
            if self.arrived[piece.param] == self.expected[piece.param]:
                complete.append(piece.param)
        if complete:
            if self.first_update_at is None:
                self.first_update_at = self.progress()
            self.homes.restore(complete)  # their gradients are final: the update goes where step() points them
            worker = self.shard.grads.worker
            assert worker is not None, "early updates only with ZeRO-Offload"
            worker.submit(lambda: self.shard.step(complete))

    def next_step(self) -> None:
        """The step is done (or skipped): count afresh."""
        self.arrived.clear()
