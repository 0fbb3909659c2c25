"""The transports the data path's collectives run on: the protocol, torch (deepspeed.comm), mpi (mpi4py),
the lane through shared memory for ranks on one host, the deadline every wait has, the order of the job's end
(shutdown), an aborting rank's output read before it aborts (pipes) and a store per torchrun round
(elastic_store)."""

from __future__ import annotations

from typing import Any

import torch

from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.transports import shutdown
from ds_tensorshard.transports.host_shared import HostSharedComm, on_one_host
from ds_tensorshard.transports.protocol import Transport


def open_transport(config: TensorShardConfig, group: Any, device: torch.device) -> Transport:
    """The ``tensorshard.comm_backend`` transport over the data-parallel ``group``, for tensors on ``device``
    (the engine's), ended in order at exit; through shared memory where ``tensorshard.shared_memory`` and
    :func:`~ds_tensorshard.transports.host_shared.on_one_host` allow it."""
    comm: Transport
    if config.comm_backend == "mpi":
        from ds_tensorshard.transports.mpi_comm import MpiComm

        comm = MpiComm(group, config.timeout_s, device)
    else:
        from ds_tensorshard.transports.torch_comm import TorchComm

        comm = TorchComm(group, config.timeout_s, device)
    shutdown.register(comm)
    if config.shared_memory and on_one_host(comm):
        return HostSharedComm(comm)
    return comm
