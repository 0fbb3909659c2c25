"""The transports the data path's collectives run on: the protocol, torch (deepspeed.comm), mpi (mpi4py),
and the deadline every wait has."""

from __future__ import annotations

from typing import Any

import torch

from ds_tensorshard.transports.protocol import Transport


def open_transport(backend: str, group: Any, timeout_s: float, device: torch.device) -> Transport:
    """The ``tensorshard.comm_backend`` transport over the data-parallel ``group``, for tensors on ``device``
    (the engine's)."""
    if backend == "mpi":
        from ds_tensorshard.transports.mpi_comm import MpiComm

        return MpiComm(group, timeout_s, device)
    from ds_tensorshard.transports.torch_comm import TorchComm

    return TorchComm(group, timeout_s, device)
