"""The transports the data path's collectives run on: the protocol, torch (deepspeed.comm), mpi (mpi4py),
the deadline every wait has, the order of the job's end (shutdown), an aborting rank's output read before it
aborts (pipes) and a store per torchrun round (elastic_store)."""

from __future__ import annotations

from typing import Any

import torch

from ds_tensorshard.transports import shutdown
from ds_tensorshard.transports.protocol import Transport


def open_transport(backend: str, group: Any, timeout_s: float, device: torch.device) -> Transport:
    """The ``tensorshard.comm_backend`` transport over the data-parallel ``group``, for tensors on ``device``
    (the engine's), ended in order at exit."""
    comm: Transport
    if backend == "mpi":
        from ds_tensorshard.transports.mpi_comm import MpiComm

        comm = MpiComm(group, timeout_s, device)
    else:
        from ds_tensorshard.transports.torch_comm import TorchComm

        comm = TorchComm(group, timeout_s, device)
    shutdown.register(comm)
    return comm
