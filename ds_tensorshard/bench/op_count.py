"""Counting the ATen operators a piece of code dispatches, and the host syncs among them.

``with OpCounter() as counted: engine.step()`` counts every operator that reaches the dispatcher while the block
runs (after autograd and the composite decompositions: what a device would launch or the host would run),
by name (``counted.ops["aten.add_"]``), with ``counted.total``. ``counted.host_syncs`` counts the operators
that make the host wait for a device: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``
of a tensor) and the copies from a device to host memory (``aten._to_copy`` of a device tensor to the CPU,
``aten.copy_`` into a CPU tensor from a device one). On CPU ranks every tensor is on the host: there are no such
copies, only the ``_local_scalar_dense`` ones (which on a CPU wait for nothing). Operators run by C++ code that
bypasses the dispatcher (a DeepSpeed op's own kernels, mpi4py's collectives) are not seen.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SCALAR_READ = "aten._local_scalar_dense"


def _on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def device_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the operator copies a device tensor into host memory."""
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        return _on_device(args[0]) and target is not None and torch.device(target).type == "cpu"
    if func is aten.copy_.default:
        return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and _on_device(args[1])
    return False


class OpCounter(TorchDispatchMode):
    """A context manager counting the operators dispatched inside it (:attr:`ops`, by name; :attr:`total`) and
    the host syncs among them (:attr:`host_syncs`, of which :attr:`device_to_host` are copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.device_to_host = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        return self.ops[SCALAR_READ] + self.device_to_host

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket)] += 1
        self.device_to_host += device_to_host(func, args, kwargs)
        return func(*args, **kwargs)
